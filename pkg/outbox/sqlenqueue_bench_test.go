package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// BenchmarkEnqueueSQL measures enqueue throughput through fifobox_enqueue
// (migrations/00013, 00014) beside Go's outbox.Enqueue, on the same PostgreSQL in
// the same run: 4 producers, each committing transactions of one event (the
// common case) or of ten (fifobox_enqueue_batch against one Enqueue call),
// over 1,000 aggregates, and over one hot aggregate (every producer
// serialises on its row). Rounds are interleaved; each ratio is the median
// of the per-round ratios Go rate / SQL rate (issue 19's target: <= 1.3).
//
//	go test -run '^$' -bench BenchmarkEnqueueSQL -benchtime 20000x ./pkg/outbox/
func BenchmarkEnqueueSQL(b *testing.B) {
	rates := map[string][]float64{}
	shapes := []struct {
		name  string
		batch int
		aggs  int
	}{{"1-event-tx-1000-aggregates", 1, 1000}, {"10-event-tx-1000-aggregates", 10, 1000}, {"1-event-tx-1-hot-aggregate", 1, 1}}
	for round := 0; round < 3; round++ {
		for _, s := range shapes {
			for _, path := range []string{"go", "sql"} {
				b.Run(s.name+"/"+path, func(b *testing.B) {
					db := pgtest.New(b)
					rate := enqueueRate(b, db.Pool, path, s.batch, s.aggs, b.N)
					if b.N > 1 { // not the testing package's b.N = 1 probe
						rates[s.name+"/"+path] = append(rates[s.name+"/"+path], rate)
					}
					b.ReportMetric(rate, "events/s")
				})
			}
		}
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "\nenqueue: 4 producers (median of rounds)\tGo Enqueue events/s\tSQL events/s\tGo/SQL\ttarget\t\n")
	for _, s := range shapes {
		g, q := rates[s.name+"/go"], rates[s.name+"/sql"]
		var ratios []float64
		for i := range min(len(g), len(q)) {
			ratios = append(ratios, g[i]/q[i])
		}
		fmt.Fprintf(w, "%s\t%.0f\t%.0f\t%.2f\t<= 1.3\t\n", s.name, medianOf(g), medianOf(q), medianOf(ratios))
	}
	w.Flush()
}

func medianOf(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// enqueueRate commits at least n events in transactions of batch events
// from 4 producers and returns events per second.
func enqueueRate(b *testing.B, pool *pgxpool.Pool, path string, batch, aggs, n int) float64 {
	b.Helper()
	ctx := context.Background()
	payload := json.RawMessage(`{"amount_cents":1200,"currency":"EUR","items":[{"sku":"A-1","qty":2}]}`)
	var next atomic.Int64
	txs := (n + batch - 1) / batch
	var wg sync.WaitGroup
	var failed atomic.Value
	b.ResetTimer()
	start := time.Now()
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= txs {
					return
				}
				evs := make([]envelope.Envelope, batch)
				for j := range evs {
					evs[j] = envelope.Envelope{ID: uuid.Must(uuid.NewV7()).String(), Type: "order.updated", OccurredAt: time.Now(),
						AggregateType: "order", AggregateID: fmt.Sprintf("o-%d", (i*batch+j)%aggs), TenantID: "acme", SchemaVersion: 1, Payload: payload}
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					switch {
					case path == "go":
						return outbox.Enqueue(ctx, tx, evs...)
					case batch == 1:
						e := evs[0]
						_, err := tx.Exec(ctx, `SELECT fifobox_enqueue(aggregate_type => $1, aggregate_id => $2, type => $3, payload => $4,
							id => $5, occurred_at => $6, tenant_id => $7)`, e.AggregateType, e.AggregateID, e.Type, string(e.Payload), e.ID, e.OccurredAt, e.TenantID)
						return err
					default:
						items := make([]map[string]any, len(evs))
						for j, e := range evs {
							items[j] = map[string]any{"id": e.ID, "type": e.Type, "occurred_at": e.OccurredAt.Format(time.RFC3339Nano),
								"aggregate_type": e.AggregateType, "aggregate_id": e.AggregateID, "tenant_id": e.TenantID, "payload": e.Payload}
						}
						doc, _ := json.Marshal(items)
						_, err := tx.Exec(ctx, `SELECT fifobox_enqueue_batch($1::json)`, string(doc))
						return err
					}
				})
				if err != nil {
					failed.Store(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	b.StopTimer()
	if err, _ := failed.Load().(error); err != nil {
		b.Fatalf("%s enqueue: %v", path, err)
	}
	return float64(txs*batch) / took.Seconds()
}
