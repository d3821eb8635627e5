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

// Moving the wake-ups into their slots (migration 00064) keeps every
// wake-up waiting, with its id: aggregates whose only sign of life is an
// unconsumed wake-up (idle heads, or none yet) are published after the
// upgrade, in order, and new ids follow the old ones.
func TestUpgradeKeepsWaitingWakeups(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	if err := migrations.UpTo(ctx, db.Pool, 62); err != nil {
		t.Fatal(err)
	}
	const aggregates, per = 30, 3
	want := map[string]int{}
	// up-0..up-9 were published and went idle before the upgrade; the
	// events enqueued after are known only by their wake-ups.
	first := make([]envelope.Envelope, 10)
	for a := range first {
		first[a] = event(fmt.Sprintf("up-%d", a), 1)
	}
	enqueue(t, db.Pool, first...)
	rec := &outboxtest.Recorder{}
	d := newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{BatchSize: 100, PollInterval: 5 * time.Millisecond})
	if err := d.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	for s := 2; s <= per+1; s++ {
		evs := make([]envelope.Envelope, aggregates)
		for a := range evs {
			evs[a] = event(fmt.Sprintf("up-%d", a), s)
		}
		enqueue(t, db.Pool, evs...)
	}
	for a := 0; a < aggregates; a++ {
		want[fmt.Sprintf("up-%d", a)] = per
		if a < 10 {
			want[fmt.Sprintf("up-%d", a)] = per + 1
		}
	}
	var before, maxID int64
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), max(id) FROM outbox_wakeups`).Scan(&before, &maxID); err != nil {
		t.Fatal(err)
	}
	if before != aggregates*per {
		t.Fatalf("%d wake-ups waiting before the upgrade, want %d", before, aggregates*per)
	}

	if err := migrations.Up(ctx, db.Pool); err != nil {
		t.Fatalf("upgrade: %v", err)
	}
	var after, afterMax int64
	if err := db.Pool.QueryRow(ctx, `SELECT count(*), max(id) FROM outbox_wakeups`).Scan(&after, &afterMax); err != nil {
		t.Fatal(err)
	}
	if after != before || afterMax != maxID {
		t.Fatalf("after the upgrade: %d wake-ups up to id %d; want %d up to %d", after, afterMax, before, maxID)
	}
	enqueue(t, db.Pool, event("up-new", 1))
	want["up-new"] = 1
	var newID int64
	if err := db.Pool.QueryRow(ctx, `SELECT id FROM outbox_wakeups WHERE aggregate_id = 'up-new'`).Scan(&newID); err != nil || newID <= maxID {
		t.Fatalf("new wake-up id %d (%v), want above %d", newID, err, maxID)
	}
	d = newDispatcher(t, db.Pool, rec, outbox.DispatcherConfig{BatchSize: 100, PollInterval: 5 * time.Millisecond})
	if err := d.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	checkOrder(t, rec.Acks(), want, false)
	if n := count(t, db.Pool, "state <> 'sent'"); n != 0 {
		t.Fatalf("%d events left unsent", n)
	}
}
