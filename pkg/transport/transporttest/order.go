package transporttest

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// An event failing past its retries is dead-lettered and holds its
// aggregate (inbox_held): the aggregate's later events go to the DLQ
// behind it, never around it. Once fixed and redriven they are applied in
// order, 1, 2, 3 (never 3, 1, 2), and the hold is gone.
func testStrictOrderThroughDeadLetterAndRedrive(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{})
	a, b := events("A", 1, 3), events("B", 1, 3)
	w.plan(a[0], 1000) // fails every time: its retries run out
	w.start("c1", w.db.Pool, 0, inbox.ConsumerConfig{})
	w.publish(interleave(a, b)...)

	w.eventually(60*time.Second, "A's three events in the DLQ and B applied", func() bool {
		return w.depth("c1").DLQ == 3 && len(w.seqs("c1", "B")) == 3
	})
	if got := w.seqs("c1", "A"); len(got) != 0 {
		t.Fatalf("A applied %v while its first event is dead", got)
	}
	// The hold is durable and visible (fifobox status counts these rows).
	if n := w.count(`SELECT count(*) FROM inbox_held WHERE consumer = 'c1' AND group_id = 'A'`); n != 3 {
		t.Fatalf("%d held rows for A, want its 3 events", n)
	}
	head := w.settlements(func(s inbox.Settlement) bool { return s.EventID == a[0].ID })
	var actions []string
	for _, s := range head {
		actions = append(actions, s.Action)
	}
	if !slices.Equal(actions, []string{inbox.ActionRetry, inbox.ActionRetry, inbox.ActionDeadLetter}) {
		t.Errorf("A/1 settled %v, want two retries, then the dead-letter", actions)
	} else if last := head[len(head)-1]; last.Class != inbox.ClassExhausted || last.Failures != 2 {
		t.Errorf("A/1's dead-letter: class %s after %d failures, want exhausted after 2", last.Class, last.Failures)
	}

	w.fix()
	res, err := w.dep.Operations().Redrive(context.Background(), transport.RedriveRequest{Consumer: "c1", Max: 100})
	if err != nil || res.Moved != 3 {
		t.Fatalf("redrive moved %d: %v", res.Moved, err)
	}
	w.waitApplied("c1", 6, 60*time.Second)
	time.Sleep(300 * time.Millisecond) // a stray copy would show
	if got := w.seqs("c1", "A"); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("A applied in order %v, want [1 2 3]", got)
	}
	w.checkOnceInOrder("c1", append(a, b...))
	if n := w.count(`SELECT count(*) FROM inbox_held`) + w.count(`SELECT count(*) FROM inbox_parked`); n != 0 {
		t.Errorf("%d held or parked rows left after the redrive", n)
	}
	if d := w.depth("c1"); d.DLQ != 0 {
		t.Errorf("DLQ holds %d after the redrive", d.DLQ)
	}
}

// A permanently failing event holds its own aggregate only: every other
// aggregate's events flow past it, in order, while it and the events of
// its aggregate that arrive later (even much later) wait in the DLQ; a
// redrive after the fix applies them in order. A body that is not an
// envelope is dead-lettered at once and holds nothing.
func testPoisonHeldAlone(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{Consumers: []string{"c1", "c2"}})
	poison := events("P", 1, 4)
	w.plan(poison[0], -1)
	var all []envelope.Envelope
	var lists [][]envelope.Envelope
	for i := 0; i < 8; i++ {
		l := events(fmt.Sprintf("agg-%d", i), 1, 5)
		lists = append(lists, l)
		all = append(all, l...)
	}
	w.start("c1", w.db.Pool, 0, inbox.ConsumerConfig{})
	w.start("c2", w.db.Pool, 0, inbox.ConsumerConfig{})
	w.publish(interleave(append(lists, poison[:3])...)...)
	w.eventually(60*time.Second, "the other aggregates applied and P's events held", func() bool {
		return w.count(`SELECT count(*) FROM applied WHERE consumer = 'c1' AND aggregate_id <> 'P'`) == len(all) && w.depth("c1").DLQ == 3
	})
	// Later events of the poisoned aggregate go behind it too.
	w.publish(poison[3])
	w.eventually(30*time.Second, "P/4 held behind P/1", func() bool { return w.depth("c1").DLQ == 4 })
	if got := w.seqs("c1", "P"); len(got) != 0 {
		t.Fatalf("P applied %v past its dead first event", got)
	}
	// The poison is c1's alone (c2's side effect rejects it too, in its
	// own DLQ; its other aggregates flow as well).
	w.eventually(30*time.Second, "c2 applied the other aggregates", func() bool {
		return w.count(`SELECT count(*) FROM applied WHERE consumer = 'c2' AND aggregate_id <> 'P'`) == len(all)
	})
	w.fix()
	if res, err := w.dep.Operations().Redrive(context.Background(), transport.RedriveRequest{Consumer: "c1", Max: 100}); err != nil || res.Moved != 4 {
		t.Fatalf("redrive moved %d: %v", res.Moved, err)
	}
	w.waitApplied("c1", len(all)+4, 60*time.Second)
	if got := w.seqs("c1", "P"); !slices.Equal(got, []int64{1, 2, 3, 4}) {
		t.Fatalf("P applied in order %v, want [1 2 3 4]", got)
	}
	w.checkOnceInOrder("c1", append(all, poison...))
	if got := w.seqs("c2", "P"); len(got) != 0 {
		t.Errorf("c2 applied P %v though c1's redrive is c1's only", got)
	}
}

// An event that fails twice and then succeeds is still applied before its
// aggregate's later events (they wait behind it, parked), its failures are
// counted (the settlement says 2), and other aggregates are not held up.
func testRetryKeepsOrder(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{})
	slow := events("S", 1, 5)
	w.plan(slow[0], 2)
	lists := [][]envelope.Envelope{slow}
	all := append([]envelope.Envelope(nil), slow...)
	for i := 0; i < 6; i++ {
		l := events(fmt.Sprintf("agg-%d", i), 1, 4)
		lists = append(lists, l)
		all = append(all, l...)
	}
	w.start("c1", w.db.Pool, 0, inbox.ConsumerConfig{})
	w.publish(interleave(lists...)...)
	w.waitApplied("c1", len(all), 60*time.Second)
	time.Sleep(300 * time.Millisecond)
	if got := w.seqs("c1", "S"); !slices.Equal(got, []int64{1, 2, 3, 4, 5}) {
		t.Fatalf("S applied in order %v, want [1 2 3 4 5]", got)
	}
	w.checkOnceInOrder("c1", all)
	var actions []string
	var failures int
	for _, s := range w.settlements(func(s inbox.Settlement) bool { return s.EventID == slow[0].ID }) {
		actions = append(actions, s.Action)
		failures = s.Failures
	}
	if !slices.Equal(actions, []string{inbox.ActionRetry, inbox.ActionRetry, inbox.ActionApplied}) || failures != 2 {
		t.Errorf("S/1 settled %v (last with %d failures), want retry, retry, applied after 2", actions, failures)
	}
	if n := w.count(`SELECT count(*) FROM inbox_parked`); n != 0 {
		t.Errorf("%d parks left", n)
	}
}

// Events delivered again (a replay sends them a second time) are applied
// once: the second delivery is a duplicate.
func testRedeliveryDeduped(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{})
	evs := interleave(events("A", 1, 5), events("B", 1, 5))
	w.start("c1", w.db.Pool, 0, inbox.ConsumerConfig{})
	w.publish(evs...)
	w.waitApplied("c1", len(evs), 60*time.Second)
	msgs := make([]outbox.Message, len(evs))
	for i, e := range evs {
		msgs[i] = Message(e)
	}
	if sent, err := w.dep.Operations().Replay(context.Background(), "c1", msgs); err != nil || sent != len(evs) {
		t.Fatalf("replay sent %d: %v", sent, err)
	}
	w.eventually(60*time.Second, "the copies recognised", func() bool {
		return len(w.settlements(func(s inbox.Settlement) bool { return s.Action == inbox.ActionDuplicate })) == len(evs)
	})
	w.checkOnceInOrder("c1", evs)
}

// A backlog is applied a lane's waiting events per transaction (far fewer
// transactions than events), and failed commits are retried in place:
// nothing of them counts as an event's failure.
func testBatches(t *testing.T, h Harness) {
	w := newWorld(t, h, Options{})
	var lists [][]envelope.Envelope
	for i := 0; i < 10; i++ {
		lists = append(lists, events(fmt.Sprintf("agg-%d", i), 1, 20))
	}
	all := interleave(lists...)
	w.publish(all...)
	db := &countingDB{Pool: w.db.Pool, fail: 2}
	w.start("c1", db, 0, inbox.ConsumerConfig{})
	w.waitApplied("c1", len(all), 60*time.Second)
	time.Sleep(200 * time.Millisecond)
	w.checkOnceInOrder("c1", all)
	db.mu.Lock()
	begins := db.begins
	db.mu.Unlock()
	if begins >= len(all) {
		t.Errorf("%d transactions for a backlog of %d events: no batching", begins, len(all))
	}
	if n := len(w.settlements(func(s inbox.Settlement) bool { return s.Action != inbox.ActionApplied })); n != 0 {
		t.Errorf("%d settlements other than applied: the failed commits spent retry budget", n)
	}
	t.Logf("%d events in %d transactions", len(all), begins)
}
