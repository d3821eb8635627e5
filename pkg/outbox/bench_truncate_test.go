package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
)

// BenchmarkEnqueueDuringTruncation shows that producers never wait on the
// truncation of wake-up slots (migration 00064): 4 producers commit
// one-event transactions (Enqueue, 100 aggregates) as fast as they can for
// FIFOBOX_TRUNCATE_PHASE (default 10s) while two claims consume wake-ups
// every 5 ms, with and without a session calling outbox_truncate_wakeups
// every 5 ms (phases alternated, twice each). It prints the enqueue
// latency per phase (p50, p99, max), the truncations, and the requests for
// a slot's table lock seen waiting (pg_locks sampled every 2 ms) by
// producers and by anyone; producers' waits to extend a slot's file (as
// with one table) are counted apart.
//
//	go test -run '^$' -bench BenchmarkEnqueueDuringTruncation -benchtime 1x ./pkg/outbox/
func BenchmarkEnqueueDuringTruncation(b *testing.B) {
	phase := envDuration(b, "FIFOBOX_TRUNCATE_PHASE", 10*time.Second)
	for round, truncating := range []bool{false, true, false, true} {
		db := pgtest.New(b)
		ctx := context.Background()
		stop := time.Now().Add(phase)
		var (
			wg                                  sync.WaitGroup
			mu                                  sync.Mutex
			lats                                []time.Duration
			truncations, producerWaits, anyWait atomic.Int64
			otherWaits                          atomic.Int64
			pids                                []int32
			failed                              atomic.Pointer[error]
		)
		fail := func(err error) { failed.CompareAndSwap(nil, &err) }
		conns := make([]*pgx.Conn, 4)
		for i := range conns {
			c, err := pgx.Connect(ctx, db.URL)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close(ctx)
			conns[i] = c
			pids = append(pids, int32(c.PgConn().PID()))
		}
		for p, c := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := 0; time.Now().Before(stop); k++ {
					e := benchEnvelope(fmt.Sprintf("tr-%02d", (k*4+p)%100))
					start := time.Now()
					if err := pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error { return Enqueue(ctx, tx, e) }); err != nil {
						fail(err)
						return
					}
					took := time.Since(start)
					mu.Lock()
					lats = append(lats, took)
					mu.Unlock()
				}
			}()
		}
		loop := func(every time.Duration, f func() error) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(stop) {
					if err := f(); err != nil {
						fail(err)
						return
					}
					time.Sleep(every)
				}
			}()
		}
		for range 2 {
			loop(5*time.Millisecond, func() error {
				_, err := db.Pool.Exec(ctx, `SELECT outbox_consume_wakeups(2000)`)
				return err
			})
		}
		if truncating {
			loop(5*time.Millisecond, func() error {
				var did bool
				err := db.Pool.QueryRow(ctx, sqlTruncateWakeups).Scan(&did)
				if did {
					truncations.Add(1)
				}
				return err
			})
		}
		loop(2*time.Millisecond, func() error {
			var mine, all, extend int64
			err := db.Pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE l.locktype = 'relation' AND l.pid = ANY($1)),
       count(*) FILTER (WHERE l.locktype = 'relation'),
       count(*) FILTER (WHERE l.locktype <> 'relation' AND l.pid = ANY($1))
FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
WHERE NOT l.granted AND c.relnamespace = current_schema()::regnamespace AND c.relname LIKE 'outbox\_wakeups%'`, pids).Scan(&mine, &all, &extend)
			producerWaits.Add(mine)
			anyWait.Add(all)
			otherWaits.Add(extend)
			return err
		})
		wg.Wait()
		if err := failed.Load(); err != nil {
			b.Fatal(*err)
		}
		p50, _ := pct(lats, 0.50)
		p99, mx := pct(lats, 0.99)
		fmt.Printf("enqueue during truncation: round %d, truncating %-5v: %d enqueues, p50 %s, p99 %s, max %s; %d truncations; waiting requests for a slot's table lock seen: producers %d, anyone %d (producers waiting to extend a slot or on a row: %d); load %s\n",
			round+1, truncating, len(lats), ms(p50), ms(p99), ms(mx), truncations.Load(), producerWaits.Load(), anyWait.Load(), otherWaits.Load(), uptime())
		if truncating && producerWaits.Load() > 0 {
			b.Errorf("a producer waited for a lock on a wake-up slot while slots were truncated")
		}
	}
}

func benchEnvelope(aggregateID string) envelope.Envelope {
	return envelope.Envelope{ID: uuid.Must(uuid.NewV7()).String(), Type: "order.updated", OccurredAt: time.Now().UTC(),
		AggregateType: "order", AggregateID: aggregateID, SchemaVersion: 1, Payload: json.RawMessage(`{"n":1}`)}
}
