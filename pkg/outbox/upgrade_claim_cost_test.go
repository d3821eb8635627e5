package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// Upgrading to migration 00065 (the claim in PL/pgSQL, the mark's new
// signature) with work in every state: events published and idle, an event
// backing off after a failure, a dead event parking its aggregate, and a
// batch claimed before the upgrade by a dispatcher of the previous version,
// which marks it after the upgrade through the previous signature. Nothing
// is lost, published twice or out of order.
func TestUpgradeToClaimCostWithBatchInFlight(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	if err := migrations.UpTo(ctx, db.Pool, 64); err != nil {
		t.Fatal(err)
	}
	const aggregates, per = 20, 4
	for s := 1; s <= per; s++ {
		evs := make([]envelope.Envelope, aggregates)
		for a := range evs {
			evs[a] = event(fmt.Sprintf("v-%d", a), s)
		}
		enqueue(t, db.Pool, evs...)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET state = 'dead', attempts = 1, last_error = 'InvalidParameter'
		WHERE aggregate_id = 'v-5' AND aggregate_seq = 2`); err != nil {
		t.Fatal(err)
	}

	// The previous version's dispatcher, as SQL: claim, then mark with the
	// 00063 signature (published rows' ids last).
	type claimed struct {
		types, ids         []string
		wakes, next, fails []int64
		last               []int64
		acks               []outboxtest.Ack
	}
	oldClaim := func(token string, batch, maxRun int) claimed {
		t.Helper()
		rows, err := db.Pool.Query(ctx, `SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, head_wakes
			FROM outbox_claim_runs($1, $2, $3::uuid, 60000, 1000) WHERE kind = 'event'`, batch, maxRun, token)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var c claimed
		for rows.Next() {
			var id, seq, w int64
			var eventID, typ, agg string
			if err := rows.Scan(&id, &eventID, &typ, &agg, &seq, &w); err != nil {
				t.Fatal(err)
			}
			if len(c.ids) == 0 || c.ids[len(c.ids)-1] != agg {
				c.types, c.ids, c.wakes, c.next, c.fails = append(c.types, typ), append(c.ids, agg), append(c.wakes, w),
					append(c.next, seq), append(c.fails, id)
			}
			c.last = append(c.last, id)
			c.acks = append(c.acks, outboxtest.Ack{EventID: eventID, AggregateID: agg, Sequence: seq})
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if len(c.ids) == 0 {
			t.Fatal("the previous version's claim took nothing")
		}
		return c
	}
	oldMark := func(token string, c claimed, outcomes []string, next []int64) {
		t.Helper()
		n := len(c.ids)
		delays, errs, fails := make([]int64, n), make([]string, n), make([]int64, n)
		for i, o := range outcomes {
			if o == "retry" {
				delays[i], errs[i], fails[i] = 1000, "throttled", c.fails[i]
			}
		}
		var marked int64
		if err := db.Pool.QueryRow(ctx, `SELECT outbox_mark_runs($1::uuid, $2::text[], $3::text[], $4::bigint[], $5::bigint[],
			$6::text[], $7::bigint[], $8::text[], $9::bigint[], $10::bigint[])`,
			token, c.types, c.ids, c.wakes, next, outcomes, delays, errs, fails, c.last).Scan(&marked); err != nil {
			t.Fatal(err)
		}
		if marked != int64(n) {
			t.Fatalf("the previous version's mark recorded %d of %d runs", marked, n)
		}
	}

	// Before the upgrade: a batch of one event per aggregate, published
	// except its first run, which failed and backs off for a second.
	const tokenA, tokenB = "7b0c7d4e-0000-4000-8000-00000000000a", "7b0c7d4e-0000-4000-8000-00000000000b"
	a := oldClaim(tokenA, 10, 1)
	outcomes, next := make([]string, len(a.ids)), make([]int64, len(a.ids))
	for i := range a.ids {
		outcomes[i], next[i] = "sent", a.next[i]+1
	}
	outcomes[0], next[0] = "retry", a.next[0]
	oldMark(tokenA, a, outcomes, next)
	retrying := a.ids[0]
	var acks []outboxtest.Ack
	for _, ack := range a.acks {
		if ack.AggregateID != retrying {
			acks = append(acks, ack)
		}
	}
	// Then a batch in flight across the upgrade.
	b := oldClaim(tokenB, 16, 2)

	if err := migrations.Up(ctx, db.Pool); err != nil {
		t.Fatalf("upgrade: %v", err)
	}
	var lang string
	if err := db.Pool.QueryRow(ctx, `SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
		WHERE p.oid = 'outbox_claim_heads(integer, integer, uuid, bigint)'::regprocedure`).Scan(&lang); err != nil || lang != "plpgsql" {
		t.Fatalf("outbox_claim_heads after the upgrade: %q, %v; want plpgsql (migration 00065)", lang, err)
	}

	// The previous version marks its batch published, through the previous
	// signature, while the new dispatcher runs.
	rec := &outboxtest.Recorder{}
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{BatchSize: 100, PollInterval: 10 * time.Millisecond})
	runCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	outcomes, next = make([]string, len(b.ids)), make([]int64, len(b.ids))
	for i := range b.ids {
		outcomes[i] = "sent"
	}
	for _, ack := range b.acks {
		for i, id := range b.ids {
			if id == ack.AggregateID {
				next[i] = ack.Sequence + 1
			}
		}
	}
	oldMark(tokenB, b, outcomes, next)
	acks = append(acks, b.acks...)

	// Everything but the two events behind the dead one is published.
	for count(t, db.Pool, "state = 'sent'") < aggregates*per-3 && runCtx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // nothing more may follow
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := count(t, db.Pool, "aggregate_id = 'v-5' AND aggregate_seq = 2 AND state = 'dead'"); n != 1 {
		t.Fatal("the dead event is no longer dead")
	}
	if n := count(t, db.Pool, "aggregate_id = 'v-5' AND aggregate_seq > 2 AND state = 'pending'"); n != per-2 {
		t.Fatalf("%d events pending behind the dead one, want %d", n, per-2)
	}
	// Its failed attempt and the one that published it.
	if n := count(t, db.Pool, fmt.Sprintf("aggregate_id = '%s' AND aggregate_seq = 1 AND attempts = 2 AND last_error = 'throttled'", retrying)); n != 1 {
		t.Fatal("the retried event lost its failed attempt")
	}
	// Per aggregate, in the order they happened: the previous version's
	// batches (their aggregates were leased until marked), then the new
	// dispatcher's.
	byAgg := map[string][]outboxtest.Ack{}
	for _, ack := range append(acks, rec.Acks()...) {
		byAgg[ack.AggregateID] = append(byAgg[ack.AggregateID], ack)
	}
	want := map[string]int{}
	var ordered []outboxtest.Ack
	for i := 0; i < aggregates; i++ {
		agg := fmt.Sprintf("v-%d", i)
		want[agg] = per
		ordered = append(ordered, byAgg[agg]...)
	}
	want["v-5"] = 1
	if dups := checkOrder(t, ordered, want, false); dups != 0 {
		t.Fatalf("%d events published twice", dups)
	}
}
