package redrive_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
	"github.com/fifobox/fifobox/pkg/redrive"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func event(aggType, agg, typ string) envelope.Envelope {
	id, _ := uuid.NewV7()
	return envelope.Envelope{ID: id.String(), Type: typ, OccurredAt: time.Now(), AggregateType: aggType,
		AggregateID: agg, SchemaVersion: 1, Payload: json.RawMessage(`{"x":1}`)}
}

func enqueue(t *testing.T, db *pgtest.DB, evs ...envelope.Envelope) {
	t.Helper()
	ctx := context.Background()
	for _, e := range evs {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) }); err != nil {
			t.Fatal(err)
		}
	}
}

func drain(t *testing.T, db *pgtest.DB, pub outbox.Publisher) {
	t.Helper()
	d, err := outbox.NewDispatcher(db.Pool, pub, outbox.DispatcherConfig{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffCap: time.Millisecond, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		if err := d.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Dead rows re-queued are published, and the events parked behind them
// follow in sequence order; the operation is audited.
func TestRequeueDeadPublishesInOrder(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	poison := map[string]bool{}
	var evs []envelope.Envelope
	for a := 0; a < 5; a++ {
		for i := 0; i < 4; i++ {
			e := event("order", fmt.Sprintf("o-%d", a), "order.placed")
			if i == 1 && a < 3 { // the second event of o-0..o-2 dies
				poison[e.ID] = true
			}
			evs = append(evs, e)
		}
	}
	other := event("payment", "p-1", "payment.failed") // dead, other aggregate type
	poison[other.ID] = true
	enqueue(t, db, evs...)
	enqueue(t, db, other)
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		if poison[m.EventID] {
			return envelope.Permanent(errors.New("rejected"))
		}
		return nil
	}}
	drain(t, db, rec)
	st, _ := outbox.Stats(ctx, db.Pool)
	if st.Dead != 4 || st.ParkedAggregates != 4 || rec.Len() != 20-3*3 {
		t.Fatalf("before requeue: stats %+v, %d acked", st, rec.Len())
	}

	svc, err := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	// Dry run changes nothing.
	res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpRequeueDead, AggregateType: "order", DryRun: true, Actor: "test"})
	if err != nil || res.Affected != 3 || res.Aggregates != 3 {
		t.Fatalf("dry run: %+v %v", res, err)
	}
	if _, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpRequeueDead, Actor: "test"}); err == nil {
		t.Fatal("requeue without a selection accepted")
	}
	if _, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpRequeueDead, AggregateType: "order", Max: 2}); err == nil {
		t.Fatal("requeue above max accepted")
	}
	since := time.Now().Add(-time.Hour)
	res, err = svc.Execute(ctx, redrive.Command{Operation: redrive.OpRequeueDead, AggregateType: "order", Since: &redrive.Instant{Time: since}, Actor: "alice@laptop"})
	if err != nil || res.Affected != 3 || res.AuditID == 0 {
		t.Fatalf("requeue: %+v %v", res, err)
	}
	poison = map[string]bool{other.ID: true} // the order events are fixed now
	drain(t, db, rec)
	st, _ = outbox.Stats(ctx, db.Pool)
	if st.Dead != 1 || st.Pending != 0 || rec.Len() != 20 {
		t.Fatalf("after requeue: stats %+v, %d acked", st, rec.Len())
	}
	last := map[string]int64{}
	for _, a := range rec.Acks() {
		if a.Sequence != last[a.AggregateID]+1 {
			t.Fatalf("aggregate %s published %d after %d", a.AggregateID, a.Sequence, last[a.AggregateID])
		}
		last[a.AggregateID] = a.Sequence
	}

	// By event id: the payment event.
	poison = map[string]bool{}
	res, err = svc.Execute(ctx, redrive.Command{Operation: redrive.OpRequeueDead, EventIDs: []string{other.ID}, Actor: "bob"})
	if err != nil || res.Affected != 1 {
		t.Fatalf("requeue by id: %+v %v", res, err)
	}
	drain(t, db, rec)
	if rec.Len() != 21 {
		t.Fatalf("%d acked, want 21", rec.Len())
	}
	dl, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpDeadList})
	if err != nil || len(dl.Dead) != 0 {
		t.Fatalf("dead list: %+v %v", dl, err)
	}
	audit, err := redrive.ListAudit(ctx, db.Pool, 10)
	if err != nil || len(audit) != 3 {
		t.Fatalf("audit: %+v %v", audit, err)
	}
	if a := audit[2]; a.Operation != "dead-requeue" || !a.DryRun || a.Affected != 3 || a.Actor != "test" {
		t.Fatalf("dry run audit row %+v", a)
	}
	if a := audit[1]; a.Operation != "dead-requeue" || a.Actor != "alice@laptop" || a.Status != "done" || a.Affected != 3 || a.FinishedAt == nil {
		t.Fatalf("audit row %+v", a)
	}
	var p map[string]any
	_ = json.Unmarshal(audit[1].Params, &p)
	if p["aggregate_type"] != "order" || p["since"] == nil {
		t.Fatalf("audit params %s", audit[1].Params)
	}
}

// A dead event no broker will accept is discarded on purpose: its aggregate
// resumes with the events after it, in order; nothing else changes; a dry
// run changes nothing; the reason is kept on the event and in the audit.
func TestDiscardDeadResumesItsAggregate(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	a1, a2, a3, a4 := event("order", "a", "order.placed"), event("order", "a", "order.paid"), event("order", "a", "order.shipped"), event("order", "a", "order.updated")
	b1 := event("order", "b", "order.placed")
	enqueue(t, db, a1, a2, a3, a4, b1)
	rec := &outboxtest.Recorder{Fail: func(m outbox.Message) error {
		if m.EventID == a2.ID {
			return envelope.Permanent(errors.New("InvalidParameter: message too long"))
		}
		return nil
	}}
	drain(t, db, rec)
	if st, _ := outbox.Stats(ctx, db.Pool); st.Dead != 1 || st.ParkedEvents != 3 || rec.Len() != 2 {
		t.Fatalf("before discard: %+v, %d acked", st, rec.Len())
	}
	svc, err := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]redrive.Command{
		"no event ids": {Operation: redrive.OpDiscardDead, AggregateType: "order", Reason: "x"},
		"no reason":    {Operation: redrive.OpDiscardDead, EventIDs: []string{a2.ID}},
		"bad id":       {Operation: redrive.OpDiscardDead, EventIDs: []string{"nope"}, Reason: "x"},
	} {
		if _, err := svc.Execute(ctx, c); err == nil {
			t.Fatalf("%s: accepted", name)
		}
	}
	res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpDiscardDead, EventIDs: []string{a2.ID}, Reason: "too large", DryRun: true, Actor: "ops"})
	if err != nil || res.Affected != 1 {
		t.Fatalf("dry run: %+v %v", res, err)
	}
	drain(t, db, rec)
	if st, _ := outbox.Stats(ctx, db.Pool); st.Dead != 1 || rec.Len() != 2 {
		t.Fatalf("the dry run changed something: %+v, %d acked", st, rec.Len())
	}
	res, err = svc.Execute(ctx, redrive.Command{Operation: redrive.OpDiscardDead, EventIDs: []string{a2.ID}, Reason: "too large, re-issued", Actor: "ops"})
	if err != nil || res.Affected != 1 || res.AuditID == 0 {
		t.Fatalf("discard: %+v %v", res, err)
	}
	drain(t, db, rec)
	var seqs []int64
	for _, a := range rec.Acks() {
		if a.AggregateID == "a" {
			seqs = append(seqs, a.Sequence)
		}
	}
	if fmt.Sprint(seqs) != "[1 3 4]" {
		t.Fatalf("aggregate a published %v, want [1 3 4] (2 discarded)", seqs)
	}
	var state, lastErr string
	if err := db.Pool.QueryRow(ctx, `SELECT state, last_error FROM outbox WHERE event_id = $1`, a2.ID).Scan(&state, &lastErr); err != nil {
		t.Fatal(err)
	}
	if state != "discarded" || !strings.Contains(lastErr, "too large, re-issued") || !strings.Contains(lastErr, "InvalidParameter") {
		t.Fatalf("discarded event: state %s, last_error %q", state, lastErr)
	}
	if st, _ := outbox.Stats(ctx, db.Pool); st.Dead != 0 || st.Pending != 0 || st.ParkedAggregates != 0 {
		t.Fatalf("after discard: %+v", st)
	}
	audit, err := redrive.ListAudit(ctx, db.Pool, 1)
	if err != nil || len(audit) != 1 || audit[0].Operation != "dead-discard" || !strings.Contains(string(audit[0].Params), "too large, re-issued") {
		t.Fatalf("audit: %+v %v", audit, err)
	}
}

func TestUnknownOperationAndStatus(t *testing.T) {
	db := pgtest.New(t)
	svc, _ := redrive.New(db.Pool, redrive.Config{Logger: quiet})
	if _, err := svc.Execute(context.Background(), redrive.Command{Operation: "explode"}); err == nil {
		t.Fatal("unknown operation accepted")
	}
	enqueue(t, db, event("order", "o-1", "order.placed"))
	res, err := svc.Execute(context.Background(), redrive.Command{Operation: redrive.OpStatus})
	if err != nil || res.Status == nil || res.Status.Outbox.Pending != 1 {
		t.Fatalf("status %+v %v", res, err)
	}
}
