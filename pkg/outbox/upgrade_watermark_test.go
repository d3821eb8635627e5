package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

// Upgrading to the watermark (migration 00030) with a backlog in place loses
// and reorders nothing. The backlog is what the previous version (00021)
// leaves: events marked 'sent' row by row, pending ones, a run leased by a
// claim whose dispatcher crashed, an aggregate backing off after retryable
// failures, and a dead event parking its aggregate with events behind it.
func TestUpgradeToWatermarkWithBacklog(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	if err := migrations.UpTo(ctx, db.Pool, 21); err != nil {
		t.Fatal(err)
	}
	const aggregates, per = 40, 6
	want := map[string]int{}
	for s := 1; s <= per; s++ {
		evs := make([]envelope.Envelope, aggregates)
		for a := range evs {
			evs[a] = event(fmt.Sprintf("w-%d", a), s)
			want[evs[a].AggregateID] = per
		}
		enqueue(t, db.Pool, evs...)
	}
	// w-0 fails retryably until the upgrade; w-1's third event fails for
	// good (dead: w-1 is parked with 3 events behind it).
	var upgraded atomic.Bool
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		switch {
		case m.GroupID == "w-0" && !upgraded.Load():
			return outboxtest.ErrInjected
		case m.GroupID == "w-1" && m.Sequence == 3 && !upgraded.Load():
			return envelope.Permanent(errors.New("rejected"))
		}
		return nil
	}}
	// Generous statement deadlines: the test is about what the upgrade
	// keeps, and on a loaded machine a mark took longer than the default
	// MarkTimeout (2 s), so RunOnce reported the released batch as an error.
	cfg := outbox.DispatcherConfig{BatchSize: 30, MaxRun: 2, Workers: 1, BackoffBase: 20 * time.Millisecond,
		BackoffCap: 50 * time.Millisecond, PollInterval: 5 * time.Millisecond,
		Lease: 30 * time.Second, MarkTimeout: 10 * time.Second, DeadlineMargin: 11 * time.Second}
	old := newDispatcher(t, db.Pool, rec, cfg)
	for i := 0; i < 4; i++ {
		if _, err := old.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// A dispatcher of the previous version claims a run and crashes: its
	// heads stay leased for 2 s.
	if _, err := db.Pool.Exec(ctx, `SELECT * FROM outbox_claim_runs(10, 2, gen_random_uuid(), 2000, 100)`); err != nil {
		t.Fatal(err)
	}
	var sentRows, pending, dead int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'sent'), count(*) FILTER (WHERE state = 'pending'),
		count(*) FILTER (WHERE state = 'dead') FROM outbox`).Scan(&sentRows, &pending, &dead); err != nil {
		t.Fatal(err)
	}
	if sentRows != rec.Len() || sentRows == 0 || pending == 0 || dead != 1 || headCount(t, db.Pool, "retry_since IS NOT NULL") != 1 {
		t.Fatalf("before the upgrade: %d sent rows (%d acknowledged), %d pending, %d dead, %d retrying heads; want a mixed backlog",
			sentRows, rec.Len(), pending, dead, headCount(t, db.Pool, "retry_since IS NOT NULL"))
	}

	if err := migrations.Up(ctx, db.Pool); err != nil {
		t.Fatalf("upgrade: %v", err)
	}
	upgraded.Store(true)
	if n := count(t, db.Pool, "state = 'sent'"); n != sentRows {
		t.Fatalf("%d events sent after the upgrade, want the %d sent before", n, sentRows)
	}
	d := newDispatcher(t, db.Pool, rec, cfg)
	deadline := time.Now().Add(time.Minute)
	drainUntil := func(done func() bool) {
		t.Helper()
		for !done() {
			if time.Now().After(deadline) {
				t.Fatalf("not drained in time: %d events unsent", count(t, db.Pool, "state <> 'sent'"))
			}
			if res, err := d.RunOnce(ctx); err != nil {
				t.Fatal(err)
			} else if res.Claimed == 0 {
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
	// Everything but the parked aggregate drains (the crashed claim's run
	// once its lease ends, w-0 once its backoff does).
	drainUntil(func() bool { return count(t, db.Pool, "state <> 'sent'") == per-2 })
	if n := count(t, db.Pool, "aggregate_id = 'w-1' AND state = 'dead' AND aggregate_seq = 3"); n != 1 {
		t.Fatalf("w-1's dead event: %d rows, want 1", n)
	}
	if n, err := outbox.RequeueDead(ctx, db.Pool, outbox.DeadSelection{AggregateType: "order"}); err != nil || n != 1 {
		t.Fatalf("requeue: %d, %v", n, err)
	}
	drainUntil(func() bool { return count(t, db.Pool, "state <> 'sent'") == 0 })
	if dups := checkOrder(t, rec.Acks(), want, false); dups != 0 {
		t.Fatalf("%d events published twice", dups)
	}
	if n := count(t, db.Pool, "true"); n != aggregates*per {
		t.Fatalf("%d events in the outbox, want %d", n, aggregates*per)
	}
	// Nothing left for the backlog figures.
	b, err := outbox.Stats(ctx, db.Pool)
	if err != nil || b.Pending != 0 || b.Dead != 0 || b.DueEvents != 0 {
		t.Fatalf("stats after the drain: %+v, %v", b, err)
	}
}
