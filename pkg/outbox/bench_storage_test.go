package outbox

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
)

// BenchmarkOutboxStorage breaks the outbox's bytes per event down by
// relation, for the rows BenchmarkDispatchSkew writes and for rows as
// Enqueue writes them, and measures what retention costs in steady state:
//
//	go test -run '^$' -bench BenchmarkOutboxStorage -benchtime 1x ./pkg/outbox/
//
// The drain writes no outbox row (an event is sent when its head passes
// it), so the size right after the fill is the size BenchmarkDispatchSkew
// prints after its drain. Figures are deterministic for a given PostgreSQL
// version and block size; docs/performance.md ("Database cost per event")
// quotes them.
func BenchmarkOutboxStorage(b *testing.B) {
	for i := 0; i < b.N; i++ {
		var rows []storageRow
		b.Run("skew-rows", func(b *testing.B) {
			db := pgtest.New(b)
			aggs := make([]string, 100000)
			for i := range aggs {
				aggs[i] = fmt.Sprintf("u-%d", i%20000)
			}
			fillAggregates(b, db.Pool, aggs, "")
			rows = append(rows, measureStorage(b, db.Pool, fmt.Sprintf("skew benchmark's rows (%d-byte body), 100,000 over 20,000 aggregates", len(benchBody))))
		})
		b.Run("enqueue-rows", func(b *testing.B) {
			db := pgtest.New(b)
			enqueueConcurrently(b, db.Pool, 4, 10, 40000, 20000)
			rows = append(rows, measureStorage(b, db.Pool, "Enqueue's envelopes (420-character payload), 4 producers x 10 per tx, 40,000 over 20,000 aggregates"))
		})
		var window []float64
		b.Run("retention-window", func(b *testing.B) {
			window = retentionWindow(b)
		})
		printStorage(rows, window)
	}
}

type storageRow struct {
	name                   string
	total, heap, pkey, eid float64 // bytes per event
	forks                  float64 // TOAST table and index, free space and visibility maps
	aggKey, other          float64
	perPage, width         float64 // rows per 8 KB heap page, average row (pg_column_size)
	compressed             int64   // bodies stored compressed
}

func measureStorage(tb testing.TB, pool *pgxpool.Pool, name string) storageRow {
	tb.Helper()
	ctx := context.Background()
	r := storageRow{name: name}
	var n, heapBytes int64
	if err := pool.QueryRow(ctx, `
		SELECT count(*), pg_relation_size('outbox'), avg(pg_column_size(o.*))::float8,
		       count(*) FILTER (WHERE pg_column_compression(o.body) IS NOT NULL)
		FROM outbox o`).Scan(&n, &heapBytes, &r.width, &r.compressed); err != nil {
		tb.Fatal(err)
	}
	per := func(bytes int64) float64 { return float64(bytes) / float64(n) }
	r.heap = per(heapBytes)
	r.perPage = float64(n) / (float64(heapBytes) / 8192)
	rels, err := pool.Query(ctx, `
		SELECT coalesce(i.indexrelid::regclass::text, 'toast'),
		       pg_relation_size(coalesce(i.indexrelid, c.reltoastrelid)),
		       pg_total_relation_size('outbox')
		FROM pg_class c LEFT JOIN pg_index i ON i.indrelid = c.oid
		WHERE c.oid = 'outbox'::regclass`)
	if err != nil {
		tb.Fatal(err)
	}
	defer rels.Close()
	for rels.Next() {
		var rel string
		var size, total int64
		if err := rels.Scan(&rel, &size, &total); err != nil {
			tb.Fatal(err)
		}
		r.total = per(total)
		switch rel {
		case "outbox_pkey":
			r.pkey = per(size)
		case "outbox_event_id_key":
			r.eid = per(size)
		case "outbox_aggregate_seq_key":
			r.aggKey = per(size)
		default: // outbox_dead_idx and any other index
			r.other += per(size)
		}
	}
	if err := rels.Err(); err != nil {
		tb.Fatal(err)
	}
	r.forks = r.total - r.heap - r.pkey - r.eid - r.aggKey - r.other
	return r
}

// enqueueConcurrently writes n events through Enqueue from producers
// goroutines, perTx per transaction, over aggs aggregates.
func enqueueConcurrently(tb testing.TB, pool *pgxpool.Pool, producers, perTx, n, aggs int) {
	tb.Helper()
	ctx := context.Background()
	payload := strings.Repeat("x", 420)
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := 0; p < producers; p++ {
		wg.Add(1)
		go func(p int) {
			defer wg.Done()
			for lo := p * n / producers; lo < (p+1)*n/producers; lo += perTx {
				evs := make([]envelope.Envelope, 0, perTx)
				for i := lo; i < lo+perTx; i++ {
					e, err := envelope.New("order.updated", "order", fmt.Sprintf("u-%d", i%aggs), payload)
					if err != nil {
						errs <- err
						return
					}
					evs = append(evs, e)
				}
				tx, err := pool.Begin(ctx)
				if err != nil {
					errs <- err
					return
				}
				if err := Enqueue(ctx, tx, evs...); err != nil {
					_ = tx.Rollback(ctx)
					errs <- err
					return
				}
				if err := tx.Commit(ctx); err != nil {
					errs <- err
					return
				}
			}
		}(p)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		tb.Fatal(err)
	}
}

// retentionWindow runs a sliding retention window on a private cluster
// (the shared server's vacuum is held back by whatever transactions other
// clients leave open): each round inserts 40,000 events (the skew
// benchmark's rows, 2 per aggregate), marks them sent (heads past them),
// prunes the events of rounds older than the last 3 with outbox_prune, as
// `fifobox prune` does, and vacuums, as autovacuum would. It returns the
// outbox's bytes per live event after each round's insert.
func retentionWindow(tb testing.TB) []float64 {
	tb.Helper()
	ctx := context.Background()
	db := pgtest.NewIn(tb, pgtest.StartCluster(tb, "autovacuum=off"))
	exec := func(q string, args ...any) {
		tb.Helper()
		if _, err := db.Pool.Exec(ctx, q, args...); err != nil {
			tb.Fatalf("%s: %v", q, err)
		}
	}
	const aggs, per, keep, rounds = 20000, 40000, 3, 10
	var ends []time.Time
	var out []float64
	for round := 0; round < rounds; round++ {
		exec(`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body)
			SELECT `+timeOrderedUUID+`, 'order.updated', 'order', 'u-' || (g % $2), $3 + g / $2 + 1, now(), $4::bytea
			FROM generate_series(0, $1 - 1) g`, per, aggs, round*per/aggs, benchBody)
		var end time.Time
		var total, live int64
		if err := db.Pool.QueryRow(ctx, `SELECT clock_timestamp(), pg_total_relation_size('outbox'), (SELECT count(*) FROM outbox)`).
			Scan(&end, &total, &live); err != nil {
			tb.Fatal(err)
		}
		ends = append(ends, end)
		out = append(out, float64(total)/float64(live))
		// Everything published: each head past its aggregate's last event.
		exec(`INSERT INTO outbox_heads (aggregate_type, aggregate_id, next_seq, state)
			SELECT 'order', 'u-' || g, $2::bigint, 'idle' FROM generate_series(0, $1 - 1) g
			ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET next_seq = EXCLUDED.next_seq`, aggs, (round+1)*per/aggs+1)
		if round >= keep {
			after := int64(0)
			for {
				var deleted int64
				var last *int64
				var young bool
				if err := db.Pool.QueryRow(ctx, `SELECT * FROM outbox_prune($1, 5000, $2)`, after, ends[round-keep]).
					Scan(&deleted, &last, &young); err != nil {
					tb.Fatal(err)
				}
				if last == nil || young {
					break
				}
				after = *last
			}
		}
		exec(`VACUUM outbox`)
	}
	return out
}

func printStorage(rows []storageRow, window []float64) {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "\nstorage: outbox bytes per event\ttotal\theap\tTOAST+FSM+VM\tpkey\tevent_id\taggregate key\tother idx\trows/page\trow bytes\tcompressed\t\n")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%.0f\t%d\t\n",
			r.name, r.total, r.heap, r.forks, r.pkey, r.eid, r.aggKey, r.other, r.perPage, r.width, r.compressed)
	}
	w.Flush()
	if len(window) > 0 {
		var parts []string
		for _, v := range window {
			parts = append(parts, fmt.Sprintf("%.0f", v))
		}
		fmt.Printf("retention window (40,000 events per round, rounds older than 3 pruned and vacuumed), bytes per live event after each round: %s\n",
			strings.Join(parts, " "))
	}
	fmt.Println()
}
