package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// Upgrading an outbox with a backlog in place (migration 00009, the heads)
// loses and reorders nothing. The backlog is written as the previous
// version left it: events interleaved over 200 aggregates, a batch leased by
// a dispatcher of the previous version that publishes and marks it after the
// upgrade, an event backing off after a failure, and a dead event parking
// its aggregate with events behind it.
func TestUpgradeWithBacklogInPlace(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	if err := migrations.UpTo(ctx, db.Pool, 8); err != nil {
		t.Fatal(err)
	}
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// What the previous Enqueue wrote: counters and events, 10 per aggregate.
	const aggregates, per = 200, 10
	exec(`INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq)
		SELECT 'order', 'u-' || a, $2::bigint FROM generate_series(0, $1::int - 1) a`, aggregates, per)
	exec(`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body)
		SELECT gen_random_uuid(), 'order.updated', 'order', 'u-' || (g % $1::int), g / $1::int + 1, now(), '{"v":1}'::bytea
		FROM generate_series(0, $1::int * $2::int - 1) g ORDER BY g`, aggregates, per)
	// u-0..u-4: their first event was published and marked sent already.
	exec(`UPDATE outbox SET state = 'sent', sent_at = now(), attempts = 1
		WHERE aggregate_seq = 1 AND aggregate_id IN ('u-0', 'u-1', 'u-2', 'u-3', 'u-4')`)
	// u-5..u-9: their first event is leased by an old dispatcher for 3 s.
	const oldToken = "7b0c7d4e-0000-4000-8000-000000000001"
	exec(`UPDATE outbox SET claim_token = $1, attempts = 1, next_attempt_at = now() + interval '3 seconds'
		WHERE aggregate_seq = 1 AND aggregate_id IN ('u-5', 'u-6', 'u-7', 'u-8', 'u-9')`, oldToken)
	// u-10: its first event failed and backs off for 1 s.
	exec(`UPDATE outbox SET attempts = 1, last_error = 'throttled', next_attempt_at = now() + interval '1 second'
		WHERE aggregate_seq = 1 AND aggregate_id = 'u-10'`)
	// u-11: its second event is dead; 8 events wait behind it.
	exec(`UPDATE outbox SET state = 'sent', sent_at = now(), attempts = 1 WHERE aggregate_seq = 1 AND aggregate_id = 'u-11'`)
	exec(`UPDATE outbox SET state = 'dead', attempts = 10, last_error = 'InvalidParameter' WHERE aggregate_seq = 2 AND aggregate_id = 'u-11'`)

	if err := migrations.Up(ctx, db.Pool); err != nil {
		t.Fatalf("upgrade: %v", err)
	}
	// The previous claim function now claims nothing: an old dispatcher
	// still running stops taking work.
	var oldClaimed int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_claim(500, gen_random_uuid(), 60000, 0)`).Scan(&oldClaimed); err != nil || oldClaimed != 0 {
		t.Fatalf("old outbox_claim after the upgrade: %d rows, %v; want none", oldClaimed, err)
	}
	if n := headCount(t, db.Pool, "true"); n != aggregates {
		t.Fatalf("%d heads after the upgrade, want one per aggregate with a backlog (%d)", n, aggregates)
	}

	// The new dispatcher runs; the old one publishes its leased batch and
	// marks it sent the old way a second later.
	rec := &outboxtest.Recorder{}
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{BatchSize: 100, PollInterval: 10 * time.Millisecond})
	runCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	time.Sleep(time.Second)
	rows, err := db.Pool.Query(ctx, `SELECT event_id::text, aggregate_id, aggregate_seq FROM outbox WHERE claim_token = $1 ORDER BY id`, oldToken)
	if err != nil {
		t.Fatal(err)
	}
	var oldAcks []outboxtest.Ack
	for rows.Next() {
		var a outboxtest.Ack
		if err := rows.Scan(&a.EventID, &a.AggregateID, &a.Sequence); err != nil {
			t.Fatal(err)
		}
		oldAcks = append(oldAcks, a)
	}
	rows.Close()
	exec(`UPDATE outbox SET state = 'sent', sent_at = now(), next_attempt_at = now(), claim_token = NULL
		WHERE id = ANY(SELECT id FROM outbox WHERE claim_token = $1) AND claim_token = $1`, oldToken)

	// Everything but the parked aggregate drains.
	wantSent := aggregates*per - 6 - 5 - 9 // sent before, by the old dispatcher, parked
	for count(t, db.Pool, "state = 'sent'") < aggregates*per-9 && runCtx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	if got := rec.Len(); got != wantSent {
		t.Fatalf("new dispatcher published %d events, want %d", got, wantSent)
	}
	// The parked aggregate resumes, in order, once its dead event is requeued.
	if n, err := outbox.RequeueDead(ctx, db.Pool, outbox.DeadSelection{AggregateType: "order"}); err != nil || n != 1 {
		t.Fatalf("requeue: %d, %v", n, err)
	}
	for count(t, db.Pool, "state <> 'sent'") > 0 && runCtx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// Per aggregate, what reached the broker (the old dispatcher's and the
	// new one's acknowledgements, with what was sent before the upgrade)
	// runs 1..10 in order, each once.
	acks := append(oldAcks, rec.Acks()...)
	for _, agg := range []string{"u-0", "u-1", "u-2", "u-3", "u-4", "u-11"} {
		acks = append([]outboxtest.Ack{{AggregateID: agg, Sequence: 1}}, acks...)
	}
	byAgg := map[string][]outboxtest.Ack{}
	for _, a := range acks {
		byAgg[a.AggregateID] = append(byAgg[a.AggregateID], a)
	}
	want := map[string]int{}
	for a := 0; a < aggregates; a++ {
		want[fmt.Sprintf("u-%d", a)] = per
	}
	// The old dispatcher's acknowledgements happened before the new
	// dispatcher could take those aggregates (their lease), so order them by
	// aggregate: checkOrder reads each aggregate's acknowledgements in order.
	var ordered []outboxtest.Ack
	for a := 0; a < aggregates; a++ {
		ordered = append(ordered, byAgg[fmt.Sprintf("u-%d", a)]...)
	}
	if dups := checkOrder(t, ordered, want, false); dups != 0 {
		t.Fatalf("%d events published twice", dups)
	}
	if n := count(t, db.Pool, "aggregate_id = 'u-11' AND aggregate_seq = 2 AND state = 'sent'"); n != 1 {
		t.Fatal("the requeued dead event was not sent")
	}
}
