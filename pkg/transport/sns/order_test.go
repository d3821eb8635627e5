package sns_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

func sqsRecord(id string, e envelope.Envelope, receives int) events.SQSMessage {
	b, _ := e.Encode()
	return events.SQSMessage{MessageId: id, Body: string(b),
		Attributes: map[string]string{"MessageGroupId": e.AggregateID, "ApproximateReceiveCount": fmt.Sprint(receives)}}
}

func handle(t *testing.T, h *sns.Handler, recs ...events.SQSMessage) (failed []string) {
	t.Helper()
	resp, err := h.Handle(context.Background(), events.SQSEvent{Records: recs})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range resp.BatchItemFailures {
		failed = append(failed, f.ItemIdentifier)
	}
	return failed
}

func heldRows(t *testing.T, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, group string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM inbox_held WHERE group_id = $1`, group).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// failP1While records each event's side effect, except P/1's, which fails
// permanently while broken is set (until "the fix is deployed").
func failP1While(broken *atomic.Bool) inbox.Apply {
	return func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		if e.AggregateID == "P" && e.Sequence == 1 && broken.Load() {
			return envelope.Permanent(errors.New("cannot apply yet"))
		}
		return record(ctx, tx, e)
	}
}

// Strict order: once the consumer dead-letters P/1, the group's later
// events go to the DLQ behind it, with a reason naming P/1's event id; a
// redriven message that is not the group's first goes back; redrive in
// order applies the group in order and ends the hold.
func TestStrictOrderHoldsAGroupUntilRedriveAppliesItInOrder(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	var broken atomic.Bool
	broken.Store(true)
	apply := failP1While(&broken)
	dlq := &fakeDLQ{}
	h, err := sns.NewHandler(db.Pool, dlq, apply, sns.HandlerConfig{Consumer: "c", DLQURL: "d"})
	if err != nil {
		t.Fatal(err)
	}
	p1, p2, p3, p4, q1 := ev("P", 1), ev("P", 2), ev("P", 3), ev("P", 4), ev("Q", 1)

	if f := handle(t, h, sqsRecord("m1", p1, 1), sqsRecord("m2", q1, 1), sqsRecord("m3", p2, 1)); len(f) != 0 {
		t.Fatalf("failed %v, want none (dead-lettered and held records are done)", f)
	}
	if f := handle(t, h, sqsRecord("m4", p3, 1)); len(f) != 0 { // a later arrival
		t.Fatalf("failed %v", f)
	}
	if len(dlq.sent) != 3 {
		t.Fatalf("%d messages dead-lettered, want P/1, P/2, P/3", len(dlq.sent))
	}
	for i, s := range dlq.sent {
		class := aws.ToString(s.MessageAttributes[sns.AttrErrorClass].StringValue)
		reason := aws.ToString(s.MessageAttributes[sns.AttrErrorReason].StringValue)
		switch {
		case i == 0 && class != inbox.ClassPermanent:
			t.Errorf("P/1 dead-lettered as %q", class)
		case i > 0 && (class != inbox.ClassHeld || !strings.Contains(reason, p1.ID) || !strings.Contains(reason, "sequence 1")):
			t.Errorf("P/%d: class %q reason %q, want held naming event %s", i+1, class, reason, p1.ID)
		}
		if aws.ToString(s.MessageGroupId) != "P" {
			t.Errorf("DLQ group %q", aws.ToString(s.MessageGroupId))
		}
	}
	if countEffects(t, db, q1.ID) != 1 || countEffects(t, db, p2.ID) != 0 || heldRows(t, db.Pool, "P") != 3 {
		t.Fatalf("other groups must continue and P must be held (held rows %d)", heldRows(t, db.Pool, "P"))
	}
	// A message of the group that is not its first goes back to the DLQ.
	if f := handle(t, h, sqsRecord("r0", p2, 1)); len(f) != 0 || countEffects(t, db, p2.ID) != 0 || len(dlq.sent) != 4 {
		t.Fatalf("P/2 ahead of P/1: failed %v, applied %d, dead-lettered %d", f, countEffects(t, db, p2.ID), len(dlq.sent))
	}
	// Still broken: P/1 goes back with P/2 behind it.
	if f := handle(t, h, sqsRecord("r1", p1, 1), sqsRecord("r2", p2, 1)); len(f) != 0 || countEffects(t, db, p1.ID) != 0 || len(dlq.sent) != 6 {
		t.Fatalf("still failing: failed %v, dead-lettered %d", f, len(dlq.sent))
	}
	broken.Store(false)
	// Redriven in order (one batch, then the rest).
	if f := handle(t, h, sqsRecord("s1", p1, 1), sqsRecord("s2", p2, 1)); len(f) != 0 {
		t.Fatalf("redrive: failed %v", f)
	}
	if f := handle(t, h, sqsRecord("s3", p3, 1)); len(f) != 0 {
		t.Fatalf("redrive: failed %v", f)
	}
	if n := heldRows(t, db.Pool, "P"); n != 0 {
		t.Fatalf("%d held rows left after the group was applied", n)
	}
	if f := handle(t, h, sqsRecord("m5", p4, 1)); len(f) != 0 {
		t.Fatalf("after the hold: failed %v", f)
	}
	rows, _ := db.Pool.Query(context.Background(), `SELECT sequence FROM effects WHERE aggregate_id = 'P' ORDER BY n`)
	seqs, _ := pgx.CollectRows(rows, pgx.RowTo[int64])
	if fmt.Sprint(seqs) != "[1 2 3 4]" {
		t.Fatalf("P applied as %v, want [1 2 3 4] once each", seqs)
	}
}

// A record failing on its last receive is dead-lettered by the handler with
// its reason (class exhausted), not moved silently by SQS. Strict order
// holds its group; relaxed order lets the group continue.
func TestLastReceiveIsDeadLetteredAndHoldsItsGroup(t *testing.T) {
	t.Parallel()
	for _, order := range []inbox.Order{inbox.OrderStrict, inbox.OrderRelaxed} {
		t.Run(order.String(), func(t *testing.T) {
			t.Parallel()
			db := newDB(t)
			dlq := &fakeDLQ{}
			h, err := sns.NewHandler(db.Pool, dlq, testApply, sns.HandlerConfig{Consumer: "c", DLQURL: "d", Order: order, MaxReceiveCount: 3})
			if err != nil {
				t.Fatal(err)
			}
			x1, x2 := ev("X", 1), ev("X", 2) // X/1 always fails transiently
			if f := handle(t, h, sqsRecord("a", x1, 2), sqsRecord("b", x2, 2)); fmt.Sprint(f) != "[a b]" {
				t.Fatalf("before the last receive: failed %v, want [a b] (retried)", f)
			}
			if f := handle(t, h, sqsRecord("a", x1, 3), sqsRecord("b", x2, 3)); len(f) != 0 {
				t.Fatalf("last receive: failed %v, want none", f)
			}
			if c := aws.ToString(dlq.sent[0].MessageAttributes[sns.AttrErrorClass].StringValue); c != inbox.ClassExhausted {
				t.Fatalf("X/1 dead-lettered as %q, want exhausted", c)
			}
			wantDLQ, wantApplied := 2, 0
			if order == inbox.OrderRelaxed {
				wantDLQ, wantApplied = 1, 1
			}
			if len(dlq.sent) != wantDLQ || countEffects(t, db, x2.ID) != wantApplied {
				t.Fatalf("dead-lettered %d, X/2 applied %d; want %d and %d", len(dlq.sent), countEffects(t, db, x2.ID), wantDLQ, wantApplied)
			}
		})
	}
}

// failingBegin is a database whose transactions cannot start (the handler
// cannot finish anything), as if the invocation died mid-batch.
type failingBegin struct{ inbox.DB }

func (failingBegin) Begin(context.Context) (pgx.Tx, error) { return nil, errors.New("connection lost") }

// The hold of a record on its last receive is committed before the attempt:
// if the handler cannot finish (here: no transaction), SQS moves the record
// to the DLQ and the group's next event is still held behind it.
func TestLastReceiveHoldSurvivesAFailedInvocation(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	dlq := &fakeDLQ{}
	cfg := sns.HandlerConfig{Consumer: "c", DLQURL: "d", MaxReceiveCount: 3}
	dying, _ := sns.NewHandler(failingBegin{db.Pool}, dlq, testApply, cfg)
	h, _ := sns.NewHandler(db.Pool, dlq, testApply, cfg)
	g1, g2 := ev("G", 1), ev("G", 2)
	if f := handle(t, dying, sqsRecord("a", g1, 3)); fmt.Sprint(f) != "[a]" {
		t.Fatalf("failed %v, want [a]", f)
	}
	// SQS now moves G/1 to the DLQ; G/2 arrives.
	if f := handle(t, h, sqsRecord("b", g2, 1)); len(f) != 0 {
		t.Fatalf("failed %v", f)
	}
	if countEffects(t, db, g2.ID) != 0 || len(dlq.sent) != 1 || !strings.Contains(aws.ToString(dlq.sent[0].MessageAttributes[sns.AttrErrorReason].StringValue), g1.ID) {
		t.Fatalf("G/2 applied %d times, dead-lettered %d; want it held behind G/1", countEffects(t, db, g2.ID), len(dlq.sent))
	}
}

// Near the invocation's deadline the handler starts no more records and
// reports them failed, so what it finished is committed and acknowledged
// instead of the whole batch being lost to the timeout.
func TestHandlerStopsStartingRecordsNearTheDeadline(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	slow := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		select {
		case <-time.After(300 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return record(ctx, tx, e)
	}
	h, err := sns.NewHandler(db.Pool, &fakeDLQ{}, slow, sns.HandlerConfig{Consumer: "c", DLQURL: "d", DeadlineMargin: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var evs []envelope.Envelope
	var recs []events.SQSMessage
	for i := 0; i < 10; i++ {
		e := ev(fmt.Sprint("D", i%3), int64(i/3+1))
		evs = append(evs, e)
		recs = append(recs, sqsRecord(fmt.Sprint(i), e, 1))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := h.Handle(ctx, events.SQSEvent{Records: recs})
	if err != nil {
		t.Fatal(err)
	}
	failed := map[string]bool{}
	for _, f := range resp.BatchItemFailures {
		failed[f.ItemIdentifier] = true
	}
	done := 0
	for i, e := range evs {
		applied := countEffects(t, db, e.ID) == 1
		if applied == failed[fmt.Sprint(i)] {
			t.Fatalf("record %d: applied %v, reported failed %v; want exactly one", i, applied, failed[fmt.Sprint(i)])
		}
		if applied {
			if done != i {
				t.Fatalf("record %d applied after an earlier one was skipped", i)
			}
			done++
		}
	}
	if done == 0 || done == len(evs) {
		t.Fatalf("%d of %d records applied; want the ones started before the margin", done, len(evs))
	}
	if ctx.Err() != nil {
		t.Fatal("the handler returned after its deadline")
	}
}

// Aggregate ids (= message group ids) may carry personal data: the
// handler's log lines leave them out unless LogAggregateIDs is set.
func TestHandlerLogsNoAggregateIDsByDefault(t *testing.T) {
	t.Parallel()
	for _, optIn := range []bool{false, true} {
		t.Run(fmt.Sprint("LogAggregateIDs=", optIn), func(t *testing.T) {
			t.Parallel()
			db := newDB(t)
			var buf bytes.Buffer
			log := slog.New(slog.NewJSONHandler(&buf, nil))
			h, _ := sns.NewHandler(db.Pool, &fakeDLQ{}, testApply, sns.HandlerConfig{Consumer: "c", DLQURL: "d", Logger: log, LogAggregateIDs: optIn})
			// A/2 fails transiently, P/1 permanently (dead-lettered), then P/2 is held.
			handle(t, h, sqsRecord("1", ev("customer-4711-A", 2), 1), sqsRecord("2", ev("P", 1), 1), sqsRecord("3", ev("P", 2), 1))
			if buf.Len() == 0 {
				t.Fatal("nothing logged")
			}
			if got := strings.Contains(buf.String(), "customer-4711"); got != optIn {
				t.Fatalf("aggregate id in the logs: %v, want %v:\n%s", got, optIn, buf.String())
			}
		})
	}
}

// Strict order reads the batch's holds before any record counts: in the
// first record's round trip when no pre-holds are due and the first record
// is valid, otherwise in a round trip of its own. Either way, if the read
// fails nothing of the batch is applied, claimed or held, every record is
// reported failed, and the redelivery applies each once.
func TestStrictOrderHoldsReadFailureFailsTheBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		first func(a envelope.Envelope) events.SQSMessage
	}{
		{"read with the first record's claim", func(a envelope.Envelope) events.SQSMessage { return sqsRecord("m1", a, 1) }},
		{"read before the transaction (first record invalid)", func(envelope.Envelope) events.SQSMessage {
			return events.SQSMessage{MessageId: "m1", Body: `{"not":"an envelope"}`, Attributes: map[string]string{"MessageGroupId": "A"}}
		}},
		{"read before the transaction (pre-hold due)", func(a envelope.Envelope) events.SQSMessage { return sqsRecord("m1", a, 5) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := newDB(t)
			ctx := context.Background()
			dlq := &fakeDLQ{}
			h, err := sns.NewHandler(db.Pool, dlq, record, sns.HandlerConfig{Consumer: "c", DLQURL: "d", MaxReceiveCount: 5})
			if err != nil {
				t.Fatal(err)
			}
			a1, b1 := ev("A", 1), ev("B", 1)
			batch := []events.SQSMessage{tc.first(a1), sqsRecord("m2", b1, 1)}
			if _, err := db.Pool.Exec(ctx, `ALTER TABLE inbox_held RENAME TO inbox_held_away`); err != nil {
				t.Fatal(err)
			}
			if f := handle(t, h, batch...); len(f) != 2 {
				t.Fatalf("failed %v, want both records (the holds could not be read)", f)
			}
			var claims int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox`).Scan(&claims); err != nil {
				t.Fatal(err)
			}
			if n := countEffects(t, db, a1.ID) + countEffects(t, db, b1.ID); n != 0 || claims != 0 || len(dlq.sent) != 0 {
				t.Fatalf("after a failed holds read: %d side effects, %d inbox rows, %d dead-lettered; want none", n, claims, len(dlq.sent))
			}
			if _, err := db.Pool.Exec(ctx, `ALTER TABLE inbox_held_away RENAME TO inbox_held`); err != nil {
				t.Fatal(err)
			}
			if f := handle(t, h, batch...); len(f) != 0 {
				t.Fatalf("redelivery failed %v", f)
			}
			if n := countEffects(t, db, b1.ID); n != 1 {
				t.Fatalf("B/1 applied %d times, want 1", n)
			}
		})
	}
}

// The first record of a batch is claimed in the same round trip that reads
// the holds; when its own group turns out to be held, that claim must not
// stand: the record is held behind the group's dead-lettered head, leaves
// no inbox row, and is applied once after redrive.
func TestStrictOrderSpeculativeClaimOfAHeldGroupIsUndone(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	var broken atomic.Bool
	broken.Store(true)
	apply := failP1While(&broken)
	dlq := &fakeDLQ{}
	h, err := sns.NewHandler(db.Pool, dlq, apply, sns.HandlerConfig{Consumer: "c", DLQURL: "d"})
	if err != nil {
		t.Fatal(err)
	}
	p1, p2, q1 := ev("P", 1), ev("P", 2), ev("Q", 1)
	if f := handle(t, h, sqsRecord("m1", p1, 1)); len(f) != 0 {
		t.Fatalf("failed %v", f)
	}
	// P/2 first in its batch: claimed speculatively, then held.
	if f := handle(t, h, sqsRecord("m2", p2, 1), sqsRecord("m3", q1, 1)); len(f) != 0 {
		t.Fatalf("failed %v", f)
	}
	var p2Claims int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE event_id = $1`, p2.ID).Scan(&p2Claims); err != nil {
		t.Fatal(err)
	}
	if p2Claims != 0 || countEffects(t, db, p2.ID) != 0 || heldRows(t, db.Pool, "P") != 2 {
		t.Fatalf("P/2 behind a held P/1: %d inbox rows, %d effects, %d held rows in P; want 0, 0, 2",
			p2Claims, countEffects(t, db, p2.ID), heldRows(t, db.Pool, "P"))
	}
	if n := countEffects(t, db, q1.ID); n != 1 {
		t.Fatalf("Q/1 applied %d times, want 1 (another group is not held)", n)
	}
	// Redrive in order: both applied once, the hold ends.
	broken.Store(false)
	if f := handle(t, h, sqsRecord("r1", p1, 1), sqsRecord("r2", p2, 1)); len(f) != 0 {
		t.Fatalf("redrive failed %v", f)
	}
	if countEffects(t, db, p1.ID) != 1 || countEffects(t, db, p2.ID) != 1 || heldRows(t, db.Pool, "P") != 0 {
		t.Fatalf("after redrive: P/1 %d, P/2 %d effects, %d held rows; want 1, 1, 0",
			countEffects(t, db, p1.ID), countEffects(t, db, p2.ID), heldRows(t, db.Pool, "P"))
	}
}
