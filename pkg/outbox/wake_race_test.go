package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/fifobox/fifobox/internal/pgtest"
)

// A mark that decides "nothing left" on a snapshot taken before a producer
// committed, while the producer's wake-up is consumed by another claim
// between that snapshot and the mark's lock on the head, must not leave the
// head idle with the producer's event unsent (migration 00061). The mark is
// held at a first head another transaction locks (heads are written in key
// order), so its snapshot predates the producer's commit; the consuming
// claim locks the second head and commits after the mark reaches it. Both
// signatures of the mark: the dispatcher's since 00065, told that the claim
// saw nothing after either run (so it idles both and only the re-check can
// see race-h's event), and 00063's, kept for dispatchers of the previous
// version.
func TestWakeRacesIdleDecision(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, mark string
		last       any
	}{
		{"claim saw the end", `SELECT outbox_mark_runs($1::uuid, $2::text[], $3::text[], $4::bigint[], $5::bigint[],
			$6::text[], $7::bigint[], $8::text[], $9::bigint[], $10::boolean[])`, []bool{true, true}},
		{"00063 signature", `SELECT outbox_mark_runs($1::uuid, $2::text[], $3::text[], $4::bigint[], $5::bigint[],
			$6::text[], $7::bigint[], $8::text[], $9::bigint[], $10::bigint[])`, []int64{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			wakeRacesIdleDecision(t, tc.mark, tc.last)
		})
	}
}

func wakeRacesIdleDecision(t *testing.T, mark string, last any) {
	db := pgtest.New(t)
	ctx := context.Background()
	enqueue(t, db.Pool, event("race-a", 1), event("race-h", 1))
	token := uuid.New()
	wakes := map[string]int64{}
	rows, err := db.Pool.Query(ctx, `SELECT aggregate_id, head_wakes FROM outbox_claim_runs(10, 10, $1, 60000, 100) WHERE kind = 'event'`, token)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var w int64
		if err := rows.Scan(&id, &w); err != nil {
			t.Fatal(err)
		}
		wakes[id] = w
	}
	if rows.Err() != nil || len(wakes) != 2 {
		t.Fatalf("claimed %v, %v; want both aggregates", wakes, rows.Err())
	}

	// Hold race-a, so the mark stops there after taking its snapshot.
	holdA, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holdA.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := holdA.Exec(ctx, `SELECT 1 FROM outbox_heads WHERE aggregate_id = 'race-a' FOR NO KEY UPDATE`); err != nil {
		t.Fatal(err)
	}
	markConn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer markConn.Release()
	var markPID int
	if err := markConn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&markPID); err != nil {
		t.Fatal(err)
	}
	marked := make(chan error, 1)
	go func() {
		_, err := markConn.Exec(ctx, mark, token,
			[]string{"order", "order"}, []string{"race-a", "race-h"}, []int64{wakes["race-a"], wakes["race-h"]},
			[]int64{2, 2}, []string{"sent", "sent"}, []int64{0, 0}, []string{"", ""}, []int64{0, 0}, last)
		marked <- err
	}()
	waitBlocked := func(what string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			var n int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted`, markPID).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				return
			}
			select {
			case err := <-marked:
				t.Fatalf("the mark finished (%v) before it waited for %s", err, what)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("the mark never waited for %s", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitBlocked("race-a")

	// The producer commits race-h's next event; another claim consumes its
	// wake-up (locking race-h, which is ready: nothing to wake) and stays open.
	enqueue(t, db.Pool, event("race-h", 2))
	consumer, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer consumer.Rollback(ctx) //nolint:errcheck // committed below
	var consumerXID string
	if err := consumer.QueryRow(ctx, `SELECT outbox_consume_wakeups(100)::text, txid_current()::text`).Scan(new(string), &consumerXID); err != nil {
		t.Fatal(err)
	}
	var left int
	if err := consumer.QueryRow(ctx, `SELECT count(*) FROM outbox_wakeups`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d wake-ups left after the consuming claim (%v), want 0", left, err)
	}
	// The mark goes on to race-h and waits for the consumer.
	if err := holdA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted AND transactionid::text = $2`,
			markPID, consumerXID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the mark never waited for the consuming claim")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := consumer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-marked; err != nil {
		t.Fatal(err)
	}
	// race-h's second event must be claimable: its head ready, not idle.
	if n := headCount(t, db.Pool, "aggregate_id = 'race-h' AND state = 'ready' AND claim_token IS NULL AND next_seq = 2"); n != 1 {
		var state string
		_ = db.Pool.QueryRow(ctx, `SELECT state FROM outbox_heads WHERE aggregate_id = 'race-h'`).Scan(&state)
		t.Fatalf("race-h's head is %s after the mark: its second event is stranded", state)
	}
	var seq int64
	if err := db.Pool.QueryRow(ctx, `SELECT aggregate_seq FROM outbox_claim_runs(10, 10, $1, 60000, 100) WHERE kind = 'event' AND aggregate_id = 'race-h'`,
		uuid.New()).Scan(&seq); err != nil || seq != 2 {
		t.Fatalf("claim after the race: race-h seq %d, %v; want 2", seq, err)
	}
}
