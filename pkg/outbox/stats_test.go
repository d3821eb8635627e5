package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
)

// The backlog figures are polled (each dispatcher invocation reads them
// twice; so do `fifobox status` and make local's progress line): they must
// read the unsent rows only, however many sent rows the outbox keeps, with
// or without planner statistics.
func TestStatsReadOnlyUnsentRows(t *testing.T) {
	t.Parallel()
	for _, analyzed := range []bool{false, true} {
		t.Run(fmt.Sprintf("analyzed=%v", analyzed), func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := context.Background()
			exec := func(sql string) {
				t.Helper()
				if _, err := db.Pool.Exec(ctx, sql); err != nil {
					t.Fatalf("%s: %v", sql, err)
				}
			}
			const sent = 20000
			exec(fmt.Sprintf(`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body, state, sent_at, attempts)
SELECT gen_random_uuid(), 'order.updated', 'order', 'old-' || g, 1, now(), '\x7b7d', 'sent', now(), 1 FROM generate_series(1, %d) g`, sent))
			// 3 pending (one of them claimed) and 2 dead, each dead event
			// parking its own aggregate.
			exec(`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body, state, created_at)
SELECT gen_random_uuid(), 'order.updated', 'order', a, s, now(), '\x7b7d', st, now() - interval '2 seconds'
FROM (VALUES ('p-1', 1, 'pending'), ('p-2', 1, 'pending'), ('p-3', 1, 'pending'), ('d-1', 1, 'dead'), ('d-2', 1, 'dead')) v(a, s, st)`)
			exec(`UPDATE outbox SET claim_token = gen_random_uuid(), next_attempt_at = now() + interval '1 minute'
WHERE id = (SELECT min(id) FROM outbox WHERE state = 'pending')`)
			if analyzed {
				exec("ANALYZE outbox")
			}

			b, err := Stats(ctx, db.Pool)
			if err != nil {
				t.Fatal(err)
			}
			if b.Pending != 3 || b.InFlight != 1 || b.Dead != 2 || b.ParkedAggregates != 2 || b.OldestPendingAge < time.Second {
				t.Errorf("stats %+v; want 3 pending, 1 in flight, 2 dead, 2 parked aggregates, oldest pending >= 1s", b)
			}

			var plan []byte
			if err := db.Pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+sqlStats).Scan(&plan); err != nil {
				t.Fatal(err)
			}
			var doc []struct {
				Plan planNode `json:"Plan"`
			}
			if err := json.Unmarshal(plan, &doc); err != nil || len(doc) == 0 {
				t.Fatalf("parse plan: %v", err)
			}
			var read float64
			var scans []string
			var walk func(n planNode)
			walk = func(n planNode) {
				if n.Relation == "outbox" {
					read += (n.ActualRows + n.RemovedByFilter + n.RemovedByIndex) * max(n.Loops, 1)
					scans = append(scans, n.NodeType)
				}
				for _, c := range n.Plans {
					walk(c)
				}
			}
			walk(doc[0].Plan)
			t.Logf("stats read %.0f outbox rows (%v) beside %d sent rows", read, scans, sent)
			if read > 50 {
				t.Errorf("stats read %.0f outbox rows (%v); want only the 5 unsent ones, not the %d sent", read, scans, sent)
			}
		})
	}
}
