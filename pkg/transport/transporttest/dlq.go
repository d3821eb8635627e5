package transporttest

// The dead-letter control suite (ExerciseDLQ): per-message operations on a
// consumer's DLQ, the same on every transport.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport"
)

// DLQHarness is one transport's consumer with an empty queue and DLQ.
type DLQHarness struct {
	// Ops are the transport's operations; Consumer the consumer they act on.
	Ops      transport.Operations
	Consumer string
	// Kill puts events into the consumer's DLQ in order, as the consumer
	// dead-letters them (with an error class and reason).
	Kill func(t *testing.T, evs []envelope.Envelope)
	// Queue takes what waits in the consumer's queue, in order.
	Queue func(t *testing.T) []envelope.Envelope
	// WholeGroups: the broker shows a group's later messages without taking
	// its first one. False for SQS FIFO, which hands out a group's next
	// message only once the one before it is gone.
	WholeGroups bool
}

// ExerciseDLQ checks a transport's per-message dead-letter control: a peek
// takes nothing and leaves nothing in flight; a dry run counts what the run
// does; discarding one message, or a group, leaves every other message in
// place and in order; a redrive of one group moves only that group, in
// order. newHarness returns a fresh consumer for each case.
func ExerciseDLQ(t *testing.T, newHarness func(t *testing.T) DLQHarness) {
	t.Run("PeekTakesNothing", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		a, b := dlqEvents("a", 2), dlqEvents("b", 1)
		h.Kill(t, []envelope.Envelope{a[0], b[0], a[1]})
		dlqWait(t, h, 3)
		for i := range 2 { // twice: the first look leaves everything as it was
			p, err := h.Ops.Peek(dlqCtx(t), transport.PeekRequest{DLQSelection: transport.DLQSelection{Consumer: h.Consumer}, Limit: 100, Bodies: true})
			if err != nil {
				t.Fatalf("peek %d: %v", i, err)
			}
			want := []string{a[0].ID, b[0].ID, a[1].ID}
			if !h.WholeGroups {
				want = []string{a[0].ID, b[0].ID} // each group's first
			}
			if got := dlqKeys(p.Messages); !dlqSameOrder(got, want, p.Messages) || len(got) < len(want) {
				t.Fatalf("peek %d saw %v, want %v", i, got, want)
			}
			if p.Total != 3 || p.Complete != h.WholeGroups {
				t.Errorf("peek %d: total %d, complete %t", i, p.Total, p.Complete)
			}
			m := p.Messages[0]
			if m.Group != "a" || m.EventType != "thing.changed" || m.Sequence != 1 || m.ErrorClass != "permanent" || !strings.Contains(m.ErrorReason, "cannot apply") ||
				!strings.Contains(m.Body, a[0].ID) || m.DeadAt == nil {
				t.Errorf("peek %d: first message %+v", i, m)
			}
			d := dlqDepth(t, h)
			if d.DLQ != 3 || d.DLQInFlight > 0 {
				t.Fatalf("after peek %d: DLQ %d, in flight %d: want 3 and none in flight", i, d.DLQ, d.DLQInFlight)
			}
		}
		// One group's messages only.
		p, err := h.Ops.Peek(dlqCtx(t), transport.PeekRequest{DLQSelection: transport.DLQSelection{Consumer: h.Consumer, Groups: []string{"b"}}, Limit: 10})
		if err != nil || len(p.Messages) != 1 || p.Messages[0].Key != b[0].ID || p.Messages[0].Body != "" {
			t.Fatalf("peek of group b: %+v %v", p.Messages, err)
		}
		dlqRedriveAll(t, h, 3)
		dlqWantQueue(t, h, a[0], b[0], a[1])
	})

	t.Run("DryRunCountsWhatTheRunDoes", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		h.Kill(t, append(dlqEvents("a", 2), dlqEvents("b", 2)...))
		dlqWait(t, h, 4)
		dry, err := h.Ops.Redrive(dlqCtx(t), transport.RedriveRequest{Consumer: h.Consumer, Max: 100, DryRun: true})
		if err != nil || dry.Moved != 4 || !dry.Complete {
			t.Fatalf("dry run %+v %v: want 4, exact", dry, err)
		}
		capped, err := h.Ops.Redrive(dlqCtx(t), transport.RedriveRequest{Consumer: h.Consumer, Max: 3, DryRun: true})
		if err != nil || capped.Moved != 3 {
			t.Fatalf("dry run with max 3: %+v %v", capped, err)
		}
		if d := dlqDepth(t, h); d.DLQ != 4 {
			t.Fatalf("dry runs moved messages: DLQ %d", d.DLQ)
		}
		var last int64
		res, err := h.Ops.Redrive(dlqCtx(t), transport.RedriveRequest{Consumer: h.Consumer, Max: 100, Progress: func(moved, total int64) {
			if total >= 0 && moved > total {
				t.Errorf("progress %d of %d", moved, total)
			}
			last = moved
		}})
		if err != nil || res.Moved != dry.Moved {
			t.Fatalf("redrive moved %d (%v), the dry run said %d", res.Moved, err, dry.Moved)
		}
		if last != 4 {
			t.Errorf("last progress %d, want 4", last)
		}
		if got := len(h.Queue(t)); got != 4 {
			t.Fatalf("queue holds %d, want 4", got)
		}
	})

	t.Run("DiscardOneMessageLeavesTheRestInOrder", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		a, b := dlqEvents("a", 3), dlqEvents("b", 2)
		h.Kill(t, []envelope.Envelope{a[0], b[0], a[1], b[1], a[2]})
		dlqWait(t, h, 5)
		sel := transport.DLQSelection{Consumer: h.Consumer, Keys: []string{a[0].ID}}
		dry, err := h.Ops.Discard(dlqCtx(t), transport.DiscardRequest{DLQSelection: sel, Max: 100, DryRun: true})
		if err != nil || len(dry.Discarded) != 1 || dry.Discarded[0].Key != a[0].ID || len(dry.Missing) != 0 {
			t.Fatalf("dry run %+v %v", dry, err)
		}
		if d := dlqDepth(t, h); d.DLQ != 5 || d.DLQInFlight > 0 {
			t.Fatalf("dry run changed the DLQ: %+v", d)
		}
		res, err := h.Ops.Discard(dlqCtx(t), transport.DiscardRequest{DLQSelection: sel, Max: 100})
		if err != nil || len(res.Discarded) != 1 || res.Discarded[0].Key != a[0].ID {
			t.Fatalf("discard %+v %v", res, err)
		}
		if d := dlqDepth(t, h); d.DLQ != 4 || d.DLQInFlight > 0 {
			t.Fatalf("after discarding one: %+v, want 4 left, none in flight", d)
		}
		gone, err := h.Ops.Discard(dlqCtx(t), transport.DiscardRequest{DLQSelection: sel, Max: 100})
		if err != nil || len(gone.Discarded) != 0 || !slices.Equal(gone.Missing, []string{a[0].ID}) {
			t.Fatalf("discarding it again: %+v %v, want it missing", gone, err)
		}
		dlqRedriveAll(t, h, 4)
		dlqWantQueue(t, h, b[0], a[1], b[1], a[2])
	})

	t.Run("DiscardAGroup", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		a, b := dlqEvents("a", 2), dlqEvents("b", 2)
		h.Kill(t, []envelope.Envelope{a[0], b[0], a[1], b[1]})
		dlqWait(t, h, 4)
		res, err := h.Ops.Discard(dlqCtx(t), transport.DiscardRequest{DLQSelection: transport.DLQSelection{Consumer: h.Consumer, Groups: []string{"a"}}, Max: 100})
		if err != nil || !slices.Equal(dlqKeys(res.Discarded), []string{a[0].ID, a[1].ID}) {
			t.Fatalf("discard group a: %v %v", dlqKeys(res.Discarded), err)
		}
		dlqRedriveAll(t, h, 2)
		dlqWantQueue(t, h, b[0], b[1])
	})

	t.Run("DiscardMarksHandledAndReleasesTheHold", func(t *testing.T) {
		t.Parallel()
		testDiscardMarksHandled(t, newHarness(t))
	})

	t.Run("RedriveOneGroup", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		a, b := dlqEvents("a", 2), dlqEvents("b", 2)
		h.Kill(t, []envelope.Envelope{b[0], a[0], b[1], a[1]})
		dlqWait(t, h, 4)
		req := transport.RedriveRequest{Consumer: h.Consumer, Max: 100, Aggregates: []string{"thing/a"}, DryRun: true}
		dry, err := h.Ops.Redrive(dlqCtx(t), req)
		if err != nil || (h.WholeGroups && (dry.Moved != 2 || !dry.Complete)) || (!h.WholeGroups && dry.Moved < 1) {
			t.Fatalf("dry run of group a: %+v %v", dry, err)
		}
		req.DryRun = false
		res, err := h.Ops.Redrive(dlqCtx(t), req)
		if err != nil || res.Moved != 2 {
			t.Fatalf("redrive of group a: %+v %v", res, err)
		}
		dlqWantQueue(t, h, a[0], a[1])
		if d := dlqDepth(t, h); d.DLQ != 2 || d.DLQInFlight > 0 {
			t.Fatalf("after redriving group a: %+v, want b's 2 left, none in flight", d)
		}
		dlqRedriveAll(t, h, 2)
		dlqWantQueue(t, h, b[0], b[1])
	})
}

func dlqCtx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// events are n events of aggregate thing/agg, sequences 1..n.
func dlqEvents(agg string, n int) []envelope.Envelope {
	out := make([]envelope.Envelope, n)
	for i := range out {
		id, _ := uuid.NewV7()
		out[i] = envelope.Envelope{ID: id.String(), Type: "thing.changed", AggregateType: "thing", AggregateID: agg,
			Sequence: int64(i + 1), OccurredAt: time.Now().UTC(), SchemaVersion: 1, Payload: []byte(fmt.Sprintf(`{"n":%d}`, i+1))}
	}
	return out
}

func dlqKeys(ms []transport.DLQMessage) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.Key
	}
	return out
}

// sameOrderPerGroup: got holds want's messages, each group in want's order.
func dlqSameOrder(got, want []string, ms []transport.DLQMessage) bool {
	for _, w := range want {
		if !slices.Contains(got, w) {
			return false
		}
	}
	pos := map[string]int{}
	for i, k := range want {
		pos[k] = i
	}
	last := map[string]int{}
	for _, m := range ms {
		p, ok := pos[m.Key]
		if !ok {
			continue
		}
		if q, seen := last[m.Group]; seen && p < q {
			return false
		}
		last[m.Group] = p
	}
	return true
}

func dlqDepth(t *testing.T, h DLQHarness) transport.QueueDepth {
	t.Helper()
	d, err := h.Ops.Depths(dlqCtx(t), h.Consumer)
	if err != nil || len(d) != 1 || d[0].Error != "" {
		t.Fatalf("depths %+v %v", d, err)
	}
	return d[0]
}

func dlqWait(t *testing.T, h DLQHarness, n int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for dlqDepth(t, h).DLQ != n {
		if time.Now().After(deadline) {
			t.Fatalf("the DLQ never held %d: %+v", n, dlqDepth(t, h))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func dlqRedriveAll(t *testing.T, h DLQHarness, n int) {
	t.Helper()
	res, err := h.Ops.Redrive(dlqCtx(t), transport.RedriveRequest{Consumer: h.Consumer, Max: 100})
	if err != nil || res.Moved != n {
		t.Fatalf("redrive %+v %v, want %d moved", res, err, n)
	}
	if d := dlqDepth(t, h); d.DLQ != 0 {
		t.Fatalf("after the redrive the DLQ holds %d", d.DLQ)
	}
}

// wantQueue checks the consumer's queue holds exactly want, each group in
// order (groups may interleave as the broker likes).
func dlqWantQueue(t *testing.T, h DLQHarness, want ...envelope.Envelope) {
	t.Helper()
	var got []envelope.Envelope
	deadline := time.Now().Add(30 * time.Second)
	for len(got) < len(want) && time.Now().Before(deadline) {
		got = append(got, h.Queue(t)...)
		if len(got) < len(want) {
			time.Sleep(100 * time.Millisecond)
		}
	}
	ids := func(es []envelope.Envelope) []string {
		var out []string
		for _, e := range es {
			out = append(out, e.AggregateID+"/"+fmt.Sprint(e.Sequence))
		}
		return out
	}
	if len(got) != len(want) {
		t.Fatalf("queue holds %v, want %v", ids(got), ids(want))
	}
	byGroup := func(es []envelope.Envelope) map[string][]string {
		m := map[string][]string{}
		for _, e := range es {
			m[e.AggregateID] = append(m[e.AggregateID], e.ID)
		}
		return m
	}
	g, w := byGroup(got), byGroup(want)
	for grp, ws := range w {
		if !slices.Equal(g[grp], ws) {
			t.Fatalf("queue holds %v, want %v (each group in order)", ids(got), ids(want))
		}
	}
}

// testDiscardMarksHandled runs `fifobox dlq discard` (redrive.Service) on
// a consumer whose group a is held behind its dead first event (a/1, then
// a/2 and a/3 held behind it) and whose group b is held by b/1: status
// shows the held groups; discarding a/1, then group b, marks those events
// handled for the consumer (inbox outcome 'discarded') and moves the holds
// in the same step: a replay of them applies nothing, and the redriven
// a/2 and a/3 are applied by the consumer engine, in order, releasing the
// group.
func testDiscardMarksHandled(t *testing.T, h DLQHarness) {
	ctx := dlqCtx(t)
	db := pgtest.New(t)
	svc, err := redrive.New(db.Pool, redrive.Config{Operations: h.Ops, Logger: quietLogger})
	if err != nil {
		t.Fatal(err)
	}
	a, b := dlqEvents("a", 3), dlqEvents("b", 1)
	h.Kill(t, []envelope.Envelope{a[0], b[0], a[1], a[2]})
	dlqWait(t, h, 4)
	// The holds the consumer engine wrote when it dead-lettered them.
	for _, x := range []struct {
		e     envelope.Envelope
		class string
	}{{a[0], inbox.ClassPermanent}, {b[0], inbox.ClassPermanent}, {a[1], inbox.ClassHeld}, {a[2], inbox.ClassHeld}} {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO inbox_held (consumer, group_id, message_key, event_id, sequence, class) VALUES ($1, $2, $3, $4, $5, $6)`,
			h.Consumer, x.e.AggregateID, x.e.ID, x.e.ID, x.e.Sequence, x.class); err != nil {
			t.Fatal(err)
		}
	}
	held := func(groups, msgs int64) {
		t.Helper()
		res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus, Consumer: h.Consumer})
		if err != nil || res.Status == nil {
			t.Fatalf("status: %v", err)
		}
		for _, q := range res.Status.Queues.Consumers {
			if q.Consumer == h.Consumer {
				if q.HeldGroups != groups || q.HeldMessages != msgs || q.Error != "" {
					t.Fatalf("status of %s: %d held groups, %d held messages (%q), want %d and %d", h.Consumer, q.HeldGroups, q.HeldMessages, q.Error, groups, msgs)
				}
				return
			}
		}
		t.Fatalf("status shows no row for %s: %+v", h.Consumer, res.Status.Queues.Consumers)
	}
	held(2, 4)
	discard := func(cmd redrive.Command, marked string) {
		t.Helper()
		cmd.Operation, cmd.Consumer, cmd.Reason = redrive.OpDLQDiscard, h.Consumer, "cannot be applied"
		res, err := svc.Execute(ctx, cmd)
		if err != nil || !strings.Contains(res.Message, marked) {
			t.Fatalf("discard %+v: %q %v, want %q", cmd, res.Message, err, marked)
		}
	}
	discard(redrive.Command{Messages: []string{a[0].ID}}, "1 events marked handled")
	held(2, 3)
	discard(redrive.Command{Groups: []string{"b"}}, "1 events marked handled")
	held(1, 2)
	var discarded []string
	rows, err := db.Pool.Query(ctx, `SELECT event_id::text FROM inbox WHERE consumer = $1 AND outcome = 'discarded' ORDER BY event_id`, h.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	if discarded, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	want := []string{a[0].ID, b[0].ID}
	slices.Sort(want)
	if !slices.Equal(discarded, want) {
		t.Fatalf("inbox rows with outcome discarded: %v, want a/1 and b/1 %v", discarded, want)
	}

	// The consumer engine: a replay of the discarded events applies
	// nothing; the redriven rest of group a applies, in order.
	var mu sync.Mutex
	var applied []string
	eng, err := inbox.NewEngine(db.Pool, func(_ context.Context, _ pgx.Tx, e envelope.Envelope) error {
		mu.Lock()
		applied = append(applied, fmt.Sprintf("%s/%d", e.AggregateID, e.Sequence))
		mu.Unlock()
		return nil
	}, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{Consumer: h.Consumer, Logger: quietLogger}})
	if err != nil {
		t.Fatal(err)
	}
	handle := func(evs ...envelope.Envelope) []string {
		t.Helper()
		var recs []*inbox.Record
		for _, e := range evs {
			body, _ := e.Encode()
			recs = append(recs, &inbox.Record{ID: e.ID, Body: body})
		}
		var br recordingBroker
		if err := eng.Handle(ctx, &br, recs); err != nil {
			t.Fatal(err)
		}
		return br.got
	}
	if got := handle(a[0], b[0]); !slices.Equal(got, []string{"ack", "ack"}) || len(applied) != 0 {
		t.Fatalf("a replay of the discarded a/1 and b/1: settled %v, applied %v; want both acknowledged, nothing applied", got, applied)
	}
	dlqRedriveAll(t, h, 2)
	var back []envelope.Envelope
	for deadline := time.Now().Add(30 * time.Second); len(back) < 2 && time.Now().Before(deadline); {
		back = append(back, h.Queue(t)...)
	}
	if got := handle(back...); !slices.Equal(got, []string{"ack", "ack"}) || !slices.Equal(applied, []string{"a/2", "a/3"}) {
		t.Fatalf("the redriven rest of a: settled %v, applied %v; want a/2 then a/3", got, applied)
	}
	held(0, 0)
}

// recordingBroker records what the engine settled, in order.
type recordingBroker struct {
	mu  sync.Mutex
	got []string
}

func (b *recordingBroker) put(what string) error {
	b.mu.Lock()
	b.got = append(b.got, what)
	b.mu.Unlock()
	return nil
}

func (b *recordingBroker) Ack(context.Context, *inbox.Record) error { return b.put("ack") }
func (b *recordingBroker) Retry(context.Context, *inbox.Record, inbox.Retry) error {
	return b.put("retry")
}
func (b *recordingBroker) DeadLetter(_ context.Context, _ *inbox.Record, dl inbox.DeadLetter) error {
	return b.put("dead-letter:" + dl.Class)
}

// DiscardIntoOwnInboxTable: a consumer that dedupes through a table of
// its own (FIFOBOX_INBOX_TABLE, with no outcome column): `fifobox dlq
// discard` refuses, naming the variable, while that table cannot take the
// mark (and deletes nothing), then marks the discarded event handled there,
// not in fifobox's inbox, so the consumer's replay of it applies nothing.
// The marking is the same on every transport (pkg/redrive): one transport's
// test package runs it.
func DiscardIntoOwnInboxTable(t *testing.T, h DLQHarness) {
	ctx := dlqCtx(t)
	db := pgtest.New(t)
	own := inbox.Table{Name: "event_inbox", Consumer: "consumer_name", EventID: "event_id", ProcessedAt: "processed_at"}
	a := dlqEvents("a", 1)
	h.Kill(t, a)
	dlqWait(t, h, 1)
	discard := func() (redrive.Result, error) {
		svc, err := redrive.New(db.Pool, redrive.Config{Operations: h.Ops, Logger: quietLogger, Inbox: own})
		if err != nil {
			t.Fatal(err)
		}
		return svc.Execute(ctx, redrive.Command{Operation: redrive.OpDLQDiscard, Consumer: h.Consumer, Messages: []string{a[0].ID}, Reason: "cannot be applied"})
	}
	if _, err := discard(); err == nil || !strings.Contains(err.Error(), inbox.EnvInboxTable) {
		t.Fatalf("discard without the consumer's table: %v, want a refusal naming %s", err, inbox.EnvInboxTable)
	}
	if d := dlqDepth(t, h); d.DLQ != 1 {
		t.Fatalf("a refused discard left %d in the DLQ, want the 1 untouched", d.DLQ)
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE event_inbox (consumer_name text, event_id uuid, processed_at timestamptz NOT NULL,
	    PRIMARY KEY (consumer_name, event_id))`); err != nil {
		t.Fatal(err)
	}
	if res, err := discard(); err != nil || !strings.Contains(res.Message, "1 events marked handled") {
		t.Fatalf("discard: %+v %v", res, err)
	}
	var mine, fifobox int
	if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM event_inbox WHERE consumer_name = $1 AND event_id = $2),
	    (SELECT count(*) FROM inbox WHERE consumer = $1)`, h.Consumer, a[0].ID).Scan(&mine, &fifobox); err != nil {
		t.Fatal(err)
	}
	if mine != 1 || fifobox != 0 {
		t.Fatalf("after the discard: %d rows in the consumer's table, %d in fifobox's inbox; want 1 and 0", mine, fifobox)
	}
	applied := 0
	eng, err := inbox.NewEngine(db.Pool, func(context.Context, pgx.Tx, envelope.Envelope) error { applied++; return nil },
		inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{Consumer: h.Consumer, Inbox: own, Logger: quietLogger}})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := a[0].Encode()
	var br recordingBroker
	if err := eng.Handle(ctx, &br, []*inbox.Record{{ID: a[0].ID, Body: body}}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(br.got, []string{"ack"}) || applied != 0 {
		t.Fatalf("a replay of the discarded event: settled %v, applied %d times; want acknowledged, not applied", br.got, applied)
	}
}
