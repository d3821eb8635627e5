package amqp_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// TestTicketingRetryDLQRedrive: the inventory consumer fails two events of
// one hold transiently. Each is retried three times with growing delays,
// and its third retry lands in the DLQ with the reason; the hold's later
// event waits behind them (parked) and is applied once they are dead, while
// other holds and the notification consumer are not held up. Redrive then
// brings both back in their order and each is applied once.
func TestTicketingRetryDLQRedrive(t *testing.T) {
	t.Parallel()
	topo := amqp.Ticketing()
	for i := range topo.Consumers {
		topo.Consumers[i].Retry = fastRetry(3) // 50ms, 100ms, 200ms: the ticketing shape, faster
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

	eventually(t, 60*time.Second, "two messages in the inventory DLQ", func() bool {
		d, err := p.ops.Depths(ctx, "inventory")
		return err == nil && d[0].DLQ == 2
	})
	// Each poisoned event: three retries, then the DLQ.
	for _, e := range evs[:2] {
		var actions []string
		var last amqp.Settlement
		for _, s := range p.settledFor("inventory", e.ID) {
			if s.Action != amqp.ActionForwarded {
				actions = append(actions, s.Action)
				last = s
			}
		}
		if strings.Join(actions, ",") != "retry,retry,retry,dead-letter" || last.Attempts != 3 || last.Class != inbox.ClassTransient {
			t.Errorf("event seq %d: settlements %v (last attempts %d class %s), want three retries then the DLQ after attempt 3", e.Sequence, actions, last.Attempts, last.Class)
		}
	}
	if f := p.settledFor("inventory", evs[1].ID); len(f) == 0 || f[0].Action != amqp.ActionForwarded {
		t.Errorf("the second event was not held behind the first: %+v", f)
	}
	// The third event of the hold was applied, after the first two died.
	waitRows(t, p, func(rows []appliedRow) bool { return countEvent(rows, "inventory", evs[2].ID) == 1 })
	for _, e := range evs[:2] {
		if n := countEvent(p.applied(), "inventory", e.ID); n != 0 {
			t.Errorf("poisoned event applied %d times", n)
		}
		if n := countEvent(p.applied(), "notification", e.ID); n != 0 {
			t.Errorf("notification does not bind hold.* but applied it")
		}
	}

	// The DLQ messages carry the reason.
	r := dialRaw(t, p.vhost.URL)
	ch, _ := r.conn.Channel()
	var tags []uint64
	for i, e := range evs[:2] {
		m, ok, err := ch.Get("ticketing.inventory.dlq", false)
		if err != nil || !ok {
			t.Fatalf("DLQ message %d: %v %v", i, ok, err)
		}
		tags = append(tags, m.DeliveryTag)
		if m.MessageId != e.ID {
			t.Errorf("DLQ message %d is %s, want seq %d's %s (DLQ order)", i, m.MessageId, e.Sequence, e.ID)
		}
		reason, _ := m.Headers[amqp.HeaderErrorReason].(string)
		if m.Headers[amqp.HeaderErrorClass] != inbox.ClassTransient || !strings.Contains(reason, "inventory service unavailable") ||
			!strings.Contains(reason, "3 retries") || m.Headers[amqp.HeaderConsumer] != "inventory" {
			t.Errorf("DLQ message %d headers: %v", i, m.Headers)
		}
		if got := m.Headers["x-attempts"]; got != int32(3) {
			t.Errorf("DLQ message %d x-attempts = %v (%T), want 3", i, got, got)
		}
	}
	_ = ch.Nack(tags[len(tags)-1], true, true)
	ch.Close()

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
	time.Sleep(300 * time.Millisecond)
	for _, e := range evs {
		if n := countEvent(p.applied(), "inventory", e.ID); n != 1 {
			t.Errorf("seq %d applied %d times", e.Sequence, n)
		}
	}
	// Everything else flowed as usual.
	want := p.expect()
	for id := range want["inventory"] {
		if n := countEvent(p.applied(), "inventory", id); n != 1 {
			t.Errorf("inventory applied %s %d times", id, n)
		}
	}
	for id := range want["notification"] {
		if n := countEvent(p.applied(), "notification", id); n != 1 {
			t.Errorf("notification applied %s %d times", id, n)
		}
	}
}

// TestInvalidAndPermanentGoToTheDLQAtOnce: no retries for a body that is not
// an envelope or a side effect that says no retry can help.
func TestInvalidAndPermanentGoToTheDLQAtOnce(t *testing.T) {
	t.Parallel()
	topo := amqp.Corewrite()
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

	// An invalid message straight into the queue.
	r := dialRaw(t, p.vhost.URL)
	ch, _ := r.conn.Channel()
	if err := ch.PublishWithContext(ctx, "", "corewrite.search-indexer", true, false, amqpPublishing("not-an-envelope", []byte(`{"v":1,"id":"nope"}`))); err != nil {
		t.Fatal(err)
	}
	ch.Close()

	eventually(t, 30*time.Second, "two DLQ messages for search-indexer", func() bool {
		d, err := p.ops.Depths(ctx, "search-indexer")
		return err == nil && d[0].DLQ == 2
	})
	classes := map[string]bool{}
	for _, m := range r.get("corewrite.search-indexer.dlq") {
		classes[m.Headers[amqp.HeaderErrorClass].(string)] = true
		if a := m.Headers["x-attempts"]; a != nil && a != int32(0) {
			t.Errorf("dead-lettered after %v attempts, want at once", m.Headers["x-attempts"])
		}
	}
	if !classes[inbox.ClassInvalid] || !classes[inbox.ClassPermanent] {
		t.Errorf("DLQ classes %v, want invalid and permanent", classes)
	}
	// The permanent failure does not park the aggregate: its next event applied.
	waitRows(t, p, func(rows []appliedRow) bool {
		return len(rowsOf(rows, "search-indexer")) == 1 && len(rowsOf(rows, "cache-invalidator")) == 2
	})
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

// TestRetryKeepsAggregateOrder: an event that fails twice and then succeeds
// is still applied before the later events of its aggregate (they wait
// behind it in the delay queues), while other aggregates are not held up.
func TestRetryKeepsAggregateOrder(t *testing.T) {
	t.Parallel()
	topo := amqp.Corewrite()
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
	if s := p.settledFor("search-indexer", head.ID); len(s) != 3 || s[0].Action != amqp.ActionRetry || s[1].Action != amqp.ActionRetry || s[2].Action != amqp.ActionApplied {
		t.Errorf("head settlements: %+v", s)
	}
}
