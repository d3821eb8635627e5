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
			exec(fmt.Sprintf(`INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq)
SELECT 'order', 'old-' || g, 1 FROM generate_series(1, %d) g`, sent))
			// Unsent: p-1 (2 events, claimed), p-2 (1 event, due), r-1 (3
			// events, backing off after a failure), d-1 and d-2 (dead heads,
			// 1 and 2 events each: parked).
			exec(`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body, state, created_at)
SELECT gen_random_uuid(), 'order.updated', 'order', a, s, now(), '\x7b7d', st, now() - make_interval(secs => age)
FROM (VALUES ('r-1', 1, 'pending', 90), ('r-1', 2, 'pending', 90), ('r-1', 3, 'pending', 90),
             ('d-1', 1, 'dead', 60), ('d-2', 1, 'dead', 60), ('d-2', 2, 'pending', 60),
             ('p-2', 1, 'pending', 5), ('p-1', 1, 'pending', 2), ('p-1', 2, 'pending', 2)) v(a, s, st, age)
ORDER BY age DESC, a, s`)
			exec(`INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq)
SELECT 'order', aggregate_id, max(aggregate_seq) FROM outbox WHERE state <> 'sent' GROUP BY aggregate_id`)
			exec(`SELECT outbox_rebuild_heads()`)
			exec(`UPDATE outbox_heads SET claim_token = gen_random_uuid(), due_at = now() + interval '1 minute' WHERE aggregate_id = 'p-1'`)
			exec(`UPDATE outbox_heads SET retry_since = now() - interval '1 minute', due_at = now() + interval '30 seconds' WHERE aggregate_id = 'r-1'`)
			if analyzed {
				exec("ANALYZE outbox")
				exec("ANALYZE outbox_heads")
				exec("ANALYZE outbox_aggregates")
			}

			b, err := Stats(ctx, db.Pool)
			if err != nil {
				t.Fatal(err)
			}
			want := Backlog{Pending: 7, DueEvents: 3, BackingOffEvents: 3, ParkedEvents: 3, RetryingAggregates: 1,
				InFlight: 1, Dead: 2, ParkedAggregates: 2}
			got := b
			got.OldestPendingAge, got.OldestDueAge, got.OldestTransactionAge = 0, 0, 0
			if got != want {
				t.Errorf("stats %+v;\nwant %+v", got, want)
			}
			// The oldest pending event (r-1, 90 s) is backing off: the publish
			// lag counts due events only (p-2 waited 5 s; p-1 is in flight
			// and counts too, 2 s).
			if b.OldestPendingAge < 85*time.Second || b.OldestDueAge < 4*time.Second || b.OldestDueAge > 20*time.Second {
				t.Errorf("oldest pending %s, oldest due %s; want ~90s and ~5s", b.OldestPendingAge, b.OldestDueAge)
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
				switch n.Relation {
				case "outbox", "outbox_aggregates", "outbox_heads":
					read += (n.ActualRows + n.RemovedByFilter + n.RemovedByIndex) * max(n.Loops, 1)
					scans = append(scans, n.NodeType)
				}
				for _, c := range n.Plans {
					walk(c)
				}
			}
			walk(doc[0].Plan)
			t.Logf("stats read %.0f rows of outbox, heads and counters (%v) beside %d sent events and their aggregates", read, scans, sent)
			if read > 100 {
				t.Errorf("stats read %.0f rows (%v); want only those of the 9 unsent events and 5 busy aggregates, not the %d sent", read, scans, sent)
			}
		})
	}
}

// Stats reports the server's oldest transaction that holds back vacuum,
// whoever holds it: here another session that took a transaction id.
func TestStatsOldestTransactionAge(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	holder, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the test's held transaction
	if _, err := tx.Exec(ctx, "SELECT txid_current()"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	st, err := Stats(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	// Other tests' sessions share the server: older ones may be reported.
	if st.OldestTransactionAge < 1500*time.Millisecond || st.OldestTransactionPartial {
		t.Fatalf("oldest transaction %s (partial %v); want at least the 1.5 s one held here, seen whole", st.OldestTransactionAge, st.OldestTransactionPartial)
	}
}

// An event no claim can reach (written around the enqueue path: here by the
// owner with aggregate_seq set and no wake-up, or behind an idle head)
// counts as stranded once older than StrandedAfter, and RebuildHeads makes
// it claimable again. Events a claim will reach (a ready or dead head at or
// below them, a wake-up) and young ones never count.
func TestStatsCountStrandedEvents(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	exec := func(sql string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	old := fmt.Sprintf("now() - interval '%d seconds'", int(StrandedAfter.Seconds())+60)
	exec(`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body, state, created_at)
SELECT gen_random_uuid(), 'order.updated', 'order', a, s, now(), '\x7b7d', st, ` + old + ` + make_interval(secs => young)
FROM (VALUES ('s-1', 1, 'pending', 0),   -- no head, no wake-up: stranded
             ('s-1', 2, 'pending', 0),   -- and its successor
             ('s-2', 1, 'pending', 0),   -- behind an idle head: stranded
             ('s-3', 1, 'pending', 0),   -- ready head: the claim reaches it
             ('s-4', 1, 'pending', 0),   -- a wake-up will make its head
             ('s-5', 1, 'pending', 300), -- younger than StrandedAfter
             ('s-6', 1, 'pending', 0),   -- below its head's next_seq
             ('s-7', 1, 'dead', 0),      -- parked behind a dead head
             ('s-7', 2, 'pending', 0)) v(a, s, st, young)`)
	exec(`INSERT INTO outbox_heads (aggregate_type, aggregate_id, next_seq, state) VALUES
  ('order', 's-2', 1, 'idle'), ('order', 's-3', 1, 'ready'), ('order', 's-6', 2, 'idle'), ('order', 's-7', 1, 'dead')`)
	exec(`INSERT INTO outbox_wakeups (aggregate_type, aggregate_id) VALUES ('order', 's-4')`)

	b, err := Stats(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if b.StrandedEvents != 3 {
		t.Fatalf("stranded %d, want 3 (s-1 #1 and #2, s-2 #1)", b.StrandedEvents)
	}
	if _, err := RebuildHeads(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	if b, err = Stats(ctx, db.Pool); err != nil || b.StrandedEvents != 0 {
		t.Fatalf("after RebuildHeads: stranded %d (%v), want 0", b.StrandedEvents, err)
	}
}
