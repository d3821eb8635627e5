package redrive_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
	"github.com/fifobox/fifobox/pkg/redrive"
)

// After a publish fails (the topic was deleted) an aggregate backs off;
// status says why, and once the cause is fixed retry-now makes it due, so
// the very next dispatch publishes it, without waiting out the backoff.
func TestRetryNowPublishesABackingOffAggregateInTheNextDispatch(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	a, b := event("order", "o-1", "order.placed"), event("order", "o-2", "order.placed")
	enqueue(t, db, a, b)
	var broken atomic.Bool
	broken.Store(true)
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		if broken.Load() {
			return errors.New("publish: operation error SNS: PublishBatch, https response error StatusCode: 404, RequestID: " +
				strings.Repeat("5b1c", 8) + ", NotFoundException: Topic does not exist")
		}
		return nil
	}}
	// A backoff of up to an hour: without retry-now nothing goes for a while.
	d, err := outbox.NewDispatcher(db.Pool, rec, outbox.DispatcherConfig{BackoffBase: time.Hour, BackoffCap: time.Hour, RetryFor: 48 * time.Hour, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	// Full jitter may have drawn a short delay: make both back off an hour,
	// so the dispatch below can only publish what retry-now made due.
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox_heads SET due_at = now() + interval '1 hour' WHERE retry_since IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	broken.Store(false) // the topic is back

	svc, _ := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	st, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus})
	if err != nil {
		t.Fatal(err)
	}
	if o := st.Status.Outbox; o.RetryingAggregates != 2 || o.BackingOffEvents != 2 {
		t.Fatalf("status outbox %+v, want 2 aggregates backing off", o)
	}
	cl := st.Status.Errors.Classes
	if len(cl) != 1 || cl[0].Kind != "retrying" || cl[0].Count != 2 || !strings.Contains(cl[0].Class, "RequestID: <id>, NotFoundException: Topic does not exist") ||
		!strings.Contains(cl[0].Newest, strings.Repeat("5b1c", 8)) || strings.Contains(cl[0].Class, "5b1c") {
		t.Fatalf("error classes %+v", cl)
	}

	for _, cmd := range []redrive.Command{
		{Operation: redrive.OpRetryNow, DryRun: true},
		{Operation: redrive.OpRetryNow, Error: "AccessDenied"},
		{Operation: redrive.OpRetryNow, AggregateIDs: []string{"o-9"}},
	} {
		res, err := svc.Execute(ctx, cmd)
		want := int64(0)
		if cmd.DryRun {
			want = 2
		}
		if err != nil || res.Affected != want {
			t.Fatalf("%+v: %+v %v, want %d", cmd, res, err, want)
		}
	}
	if n, err := d.RunOnce(ctx); err != nil || n.Claimed != 0 {
		t.Fatalf("dispatch before retry-now claimed %d (%v): the aggregates should still back off", n.Claimed, err)
	}
	res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpRetryNow, AggregateIDs: []string{"o-1"}, Error: "Topic does not exist", Actor: "alice"})
	if err != nil || res.Aggregates != 1 || res.Affected != 1 || res.AuditID == 0 {
		t.Fatalf("retry-now: %+v %v", res, err)
	}
	n, err := d.RunOnce(ctx)
	if err != nil || n.Sent != 1 {
		t.Fatalf("the next dispatch sent %d (%v), want o-1's event", n.Sent, err)
	}
	if acks := rec.Acks(); len(acks) != 1 || acks[0].EventID != a.ID {
		t.Fatalf("published %+v, want only o-1's event", acks)
	}
	audit, _ := redrive.ListAudit(ctx, db.Pool, 1)
	if len(audit) != 1 || audit[0].Operation != redrive.OpRetryNow || audit[0].Actor != "alice" || audit[0].Affected != 1 ||
		!strings.Contains(string(audit[0].Params), `"aggregate_ids": ["o-1"]`) {
		t.Fatalf("audit %+v", audit)
	}
	// o-2 still backs off, and its event is still the retrying one.
	st, _ = svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus})
	if o := st.Status.Outbox; o.RetryingAggregates != 1 || o.Pending != 1 {
		t.Fatalf("after: %+v", o)
	}
}

// Dead events' errors are classes too, beside retrying ones.
func TestStatusErrorClassesOfDeadEvents(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	var evs []envelope.Envelope
	for _, agg := range []string{"o-1", "o-2", "o-3"} {
		evs = append(evs, event("order", agg, "order.placed"))
	}
	enqueue(t, db, evs...)
	n := 0
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		n++
		return envelope.Permanent(errors.New("publish: InvalidParameter: message " + m.EventID + " is 262145 bytes, over 262144"))
	}}
	drain(t, db, rec)
	svc, _ := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	st, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus})
	if err != nil {
		t.Fatal(err)
	}
	cl := st.Status.Errors.Classes
	if len(cl) != 1 || cl[0].Kind != "dead" || cl[0].Count != 3 || cl[0].Class != "permanent: publish: InvalidParameter: message <id> is <n> bytes, over <n>" {
		t.Fatalf("classes %+v", cl)
	}
	if !strings.Contains(cl[0].Newest, evs[2].ID) {
		t.Errorf("newest %q, want the last event's", cl[0].Newest)
	}
}

// An event written around the enqueue path (the owner setting
// aggregate_seq, no wake-up) is never claimed: status counts it stranded
// once it has waited outbox.StrandedAfter, and repair-heads makes the next
// dispatch publish it, after the events its aggregate already had.
func TestRepairHeadsPublishesStrandedEvents(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	a := event("order", "o-1", "order.placed")
	enqueue(t, db, a)
	rec := &outboxtest.Recorder{}
	d, err := outbox.NewDispatcher(db.Pool, rec, outbox.DispatcherConfig{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Drain(ctx); err != nil || rec.Len() != 1 {
		t.Fatalf("drain: %d published, %v", rec.Len(), err)
	}
	// A restore written by the owner, sequences kept: o-1 #2 and o-9 #1.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body, created_at)
		VALUES (gen_random_uuid(), 'order.paid', 'order', 'o-1', 2, now(), '{}', now() - interval '10 minutes'),
		       (gen_random_uuid(), 'order.placed', 'order', 'o-9', 1, now(), '{}', now() - interval '10 minutes')`); err != nil {
		t.Fatal(err)
	}
	if err := d.Drain(ctx); err != nil || rec.Len() != 1 {
		t.Fatalf("drain before repair: %d published (%v), want still 1: the restored events are stranded", rec.Len(), err)
	}
	svc, _ := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	st, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus})
	if err != nil || st.Status.Outbox.StrandedEvents != 2 {
		t.Fatalf("status: stranded %d (%v), want 2", st.Status.Outbox.StrandedEvents, err)
	}
	if res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpRepairHeads, DryRun: true, Actor: "alice"}); err != nil || res.Affected != 2 {
		t.Fatalf("repair-heads dry run: %+v %v, want 2 stranded", res, err)
	}
	if res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpRepairHeads, Actor: "alice"}); err != nil || res.AuditID == 0 {
		t.Fatalf("repair-heads: %+v %v", res, err)
	}
	if err := d.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	acks := rec.Acks()
	if len(acks) != 3 || acks[0].Sequence != 1 || acks[0].AggregateID != "o-1" {
		t.Fatalf("published %+v, want o-1 #1 and then the two restored events", acks)
	}
	if st, err = svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus}); err != nil || st.Status.Outbox.StrandedEvents != 0 {
		t.Fatalf("status after repair: stranded %d (%v), want 0", st.Status.Outbox.StrandedEvents, err)
	}
}
