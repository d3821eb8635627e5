package nats_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
)

// TestRetryDLQRedrive: the inventory consumer fails two events of one hold
// transiently. Each is retried three times with growing delays (NakWithDelay)
// and then dead-lettered with the reason; the hold's later event is held
// behind them and applied once they are dead, while other holds and the
// notification consumer are not held up. Redrive then brings both back in
// their order and each is applied once.
func TestRetryDLQRedrive(t *testing.T) {
	t.Parallel()
	topo := nats.Ticketing()
	for i := range topo.Consumers {
		topo.Consumers[i].Retry = fastRetry(3) // 50ms, 100ms, 200ms
	}
	p := newPipeline(t, topo)
	ctx := context.Background()

	bad := map[string]bool{}
	p.setFail(func(consumer string, e envelope.Envelope) error {
		if consumer == "inventory" && bad[e.ID] {
			return errors.New("inventory service unavailable")
		}
		return nil
	})
	p.mu.Lock()
	evs := []envelope.Envelope{
		newEvent("hold", "h-poison", "hold.created", 0),
		newEvent("hold", "h-poison", "hold.expired", 0),
		newEvent("hold", "h-poison", "hold.created", 0),
	}
	bad[evs[0].ID], bad[evs[1].ID] = true, true
	p.mu.Unlock()
	evs = p.enqueue(evs...)
	p.produce(20, 4, 500*time.Millisecond, ticketingKinds)

	eventually(t, 60*time.Second, "two messages in the inventory dead letters", func() bool {
		d, err := p.ops.Depths(ctx, "inventory")
		return err == nil && d[0].DLQ == 2
	})
	for _, e := range evs[:2] {
		var actions []string
		var last nats.Settlement
		for _, s := range p.settledFor("inventory", e.ID) {
			if s.Action != nats.ActionHeld {
				actions = append(actions, s.Action)
				last = s
			}
		}
		if strings.Join(actions, ",") != "retry,retry,retry,dead-letter" || last.Deliveries != 4 || last.Class != inbox.ClassTransient {
			t.Errorf("event seq %d: settlements %v (last deliveries %d class %s), want three retries then the dead letter on delivery 4", e.Sequence, actions, last.Deliveries, last.Class)
		}
	}
	if f := p.settledFor("inventory", evs[1].ID); len(f) == 0 || f[0].Action != nats.ActionHeld {
		t.Errorf("the second event was not held behind the first: %+v", f)
	}
	waitRows(t, p, func(rows []appliedRow) bool { return countEvent(rows, "inventory", evs[2].ID) == 1 })
	for _, e := range evs[:2] {
		if n := countEvent(p.applied(), "inventory", e.ID); n != 0 {
			t.Errorf("poisoned event applied %d times", n)
		}
	}

	// The dead letters carry the reason, in the order the events died.
	r := dialRaw(t)
	c, _ := p.topo.Consumer("inventory")
	dead := r.all(p.topo.DeadLetterStream, p.topo.DLQSubject(c))
	if len(dead) != 2 {
		t.Fatalf("%d dead letters, want 2", len(dead))
	}
	for i, m := range dead {
		h := m.Headers()
		if got := h.Get(nats.HeaderEventID); got != evs[i].ID {
			t.Errorf("dead letter %d is %s, want seq %d's %s (death order)", i, got, evs[i].Sequence, evs[i].ID)
		}
		reason := h.Get(nats.HeaderErrorReason)
		if h.Get(nats.HeaderErrorClass) != inbox.ClassTransient || !strings.Contains(reason, "inventory service unavailable") ||
			!strings.Contains(reason, "3 retries") || h.Get(nats.HeaderConsumer) != "inventory" || h.Get(nats.HeaderDeliveries) != "4" {
			t.Errorf("dead letter %d headers: %v", i, h)
		}
		if !strings.HasPrefix(h.Get(nats.HeaderSubject), p.topo.SubjectPrefix+".hold_") {
			t.Errorf("dead letter %d original subject %q", i, h.Get(nats.HeaderSubject))
		}
	}

	// Fixed: redrive moves both back, in order, and each applies once.
	p.setFail(nil)
	rr, err := p.ops.Redrive(ctx, transport.RedriveRequest{Consumer: "inventory", Max: 100})
	moved := rr.Moved
	if err != nil || moved != 2 {
		t.Fatalf("redrive moved %d: %v", moved, err)
	}
	waitRows(t, p, func(rows []appliedRow) bool {
		return countEvent(rows, "inventory", evs[0].ID) == 1 && countEvent(rows, "inventory", evs[1].ID) == 1
	})
	var order []int64
	for _, row := range p.applied() {
		if row.consumer == "inventory" && row.agg == "h-poison" {
			order = append(order, row.seq)
		}
	}
	if len(order) != 3 || order[0] != 3 || order[1] != 1 || order[2] != 2 {
		t.Errorf("h-poison applied in order %v, want [3 1 2] (3 while 1 and 2 were dead, then the redriven ones in order)", order)
	}
	if rr, err := p.ops.Redrive(ctx, transport.RedriveRequest{Consumer: "inventory", Max: 100}); err != nil || rr.Moved != 0 {
		t.Errorf("second redrive moved %d (%v), want 0", rr.Moved, err)
	}
	d, err := p.ops.Depths(ctx, "inventory")
	if err != nil || d[0].DLQ != 0 {
		t.Errorf("after redrive: %+v %v, want an empty DLQ", d, err)
	}
	time.Sleep(300 * time.Millisecond)
	for _, e := range evs {
		if n := countEvent(p.applied(), "inventory", e.ID); n != 1 {
			t.Errorf("seq %d applied %d times", e.Sequence, n)
		}
	}
	// The redriven copies went to inventory only: notification never saw them.
	want := p.expect()
	for _, name := range []string{"inventory", "notification"} {
		for id := range want[name] {
			if n := countEvent(p.applied(), name, id); n != 1 {
				t.Errorf("%s applied %s %d times", name, id, n)
			}
		}
	}
}

// TestInvalidAndPermanentGoToTheDLQAtOnce: no retries for a body that is not
// an envelope or a side effect that says no retry can help.
func TestInvalidAndPermanentGoToTheDLQAtOnce(t *testing.T) {
	t.Parallel()
	topo := nats.Corewrite()
	for i := range topo.Consumers {
		topo.Consumers[i].Retry = fastRetry(3)
	}
	p := newPipeline(t, topo)
	ctx := context.Background()
	rejected := newEvent("doc", "d-1", "doc.written", 0)
	p.setFail(func(consumer string, e envelope.Envelope) error {
		if consumer == "search-indexer" && e.ID == rejected.ID {
			return envelope.Permanent(errors.New("document schema not supported"))
		}
		return nil
	})
	p.enqueue(rejected, newEvent("doc", "d-1", "doc.deleted", 0))

	// An invalid message straight into the stream: both consumers get it.
	r := dialRaw(t)
	msg := &natsgo.Msg{Subject: p.topo.SubjectPrefix + ".doc.garbage", Data: []byte(`{"v":1,"id":"nope"}`), Header: natsgo.Header{}}
	msg.Header.Set("Nats-Msg-Id", "not-an-envelope")
	if _, err := r.js.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "two dead letters for search-indexer, one for cache-invalidator", func() bool {
		d, err := p.ops.Depths(ctx)
		return err == nil && d[0].DLQ == 2 && d[1].DLQ == 1
	})
	c, _ := p.topo.Consumer("search-indexer")
	classes := map[string]bool{}
	for _, m := range r.all(p.topo.DeadLetterStream, p.topo.DLQSubject(c)) {
		classes[m.Headers().Get(nats.HeaderErrorClass)] = true
		if got := m.Headers().Get(nats.HeaderDeliveries); got != "1" {
			t.Errorf("dead-lettered after %s deliveries, want at once", got)
		}
	}
	if !classes[inbox.ClassInvalid] || !classes[inbox.ClassPermanent] {
		t.Errorf("dead-letter classes %v, want invalid and permanent", classes)
	}
	// The permanent failure does not park the aggregate: its next event applied.
	waitRows(t, p, func(rows []appliedRow) bool {
		return len(rowsOf(rows, "search-indexer")) == 1 && len(rowsOf(rows, "cache-invalidator")) == 2
	})
}

// TestRetryKeepsAggregateOrder: an event that fails twice and then succeeds
// is still applied before the later events of its aggregate (held behind
// it), while other aggregates are not held up.
func TestRetryKeepsAggregateOrder(t *testing.T) {
	t.Parallel()
	topo := nats.Corewrite()
	for i := range topo.Consumers {
		topo.Consumers[i].Retry = fastRetry(5)
	}
	p := newPipeline(t, topo)
	head := newEvent("doc", "d-slow", "doc.written", 0)
	var failures int
	p.setFail(func(consumer string, e envelope.Envelope) error {
		if consumer == "search-indexer" && e.ID == head.ID && failures < 2 {
			failures++
			return errors.New("index busy")
		}
		return nil
	})
	p.enqueue(head, newEvent("doc", "d-slow", "doc.written", 0))
	p.enqueue(newEvent("doc", "d-slow", "doc.deleted", 0))
	p.produce(10, 3, 200*time.Millisecond, corewriteKinds)
	rows := p.waitApplied(60 * time.Second) // checks per-aggregate order for every consumer
	var order []int64
	for _, r := range rowsOf(rows, "search-indexer") {
		if r.agg == "d-slow" {
			order = append(order, r.seq)
		}
	}
	if len(order) != 3 || order[0] != 1 || order[1] != 2 || order[2] != 3 {
		t.Errorf("d-slow applied in order %v, want [1 2 3]", order)
	}
	if s := p.settledFor("search-indexer", head.ID); len(s) != 3 || s[0].Action != nats.ActionRetry || s[1].Action != nats.ActionRetry || s[2].Action != nats.ActionApplied {
		t.Errorf("head settlements: %+v", s)
	}
}

func countEvent(rows []appliedRow, consumer, id string) int {
	n := 0
	for _, r := range rows {
		if r.consumer == consumer && r.eventID == id {
			n++
		}
	}
	return n
}

func rowsOf(rows []appliedRow, consumer string) []appliedRow {
	var out []appliedRow
	for _, r := range rows {
		if r.consumer == consumer {
			out = append(out, r)
		}
	}
	return out
}

func waitRows(t *testing.T, p *pipeline, cond func([]appliedRow) bool) {
	t.Helper()
	eventually(t, 60*time.Second, "applied rows", func() bool { return cond(p.applied()) })
}
