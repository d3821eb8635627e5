package transporttest

// The pipeline suite (RunPipeline): the whole flow on the real broker with
// the topologies every transport ships. Producers enqueue into the outbox,
// the dispatcher publishes through the transport, a Runner per consumer
// applies through the inbox; every consumer must apply exactly the events
// its routing selects, each once, each aggregate's in order.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// AggKind is an aggregate type and the event types its events cycle through.
type AggKind struct {
	Type   string
	Events []string
}

// Preset is one of the topologies every transport ships (amqp.Holdco,
// nats.Holdco, ...), named for Harness.Preset, with the aggregates its
// producers write.
type Preset struct {
	Name  string
	Kinds []AggKind
}

// The presets. Default is topology.Default as the transport converts it.
var (
	Holdco = Preset{"holdco", []AggKind{
		{"invoice", []string{"created", "paid", "voided"}},
		{"order", []string{"created", "shipped", "delivered"}},
		{"payment_intent", []string{"created", "failed", "succeeded"}},
		{"customer", []string{"created", "updated"}},
	}}
	Ticketing = Preset{"ticketing", []AggKind{
		{"hold", []string{"hold.created", "hold.expired"}},
		{"order", []string{"order.confirmed", "order.cancelled"}},
	}}
	Corewrite = Preset{"corewrite", []AggKind{{"doc", []string{"doc.written", "doc.deleted"}}}}
	Default   = Preset{"default", []AggKind{
		{"order", []string{"order.created", "order.paid", "order.shipped"}},
		{"customer", []string{"customer.updated"}},
	}}
)

// Routing is where a preset deployment's topology sends events.
type Routing struct {
	// Consumers are the deployment's consumers.
	Consumers []string
	// Routes returns the consumers that must receive e. Where it can, the
	// test computes it on its own rather than with the transport's routing
	// code, so a routing bug shows.
	Routes func(e envelope.Envelope) []string
}

// RunPipeline runs the pipeline tests against h's presets, each in parallel.
func RunPipeline(t *testing.T, h Harness) {
	for _, ps := range []Preset{Holdco, Ticketing, Corewrite, Default} {
		t.Run(ps.Name, func(t *testing.T) {
			t.Parallel()
			testEndToEnd(t, h, ps)
		})
	}
	t.Run("ReplayOneConsumer", func(t *testing.T) {
		t.Parallel()
		testReplayOneConsumer(t, h)
	})
}

// pipeline is a world running a preset: its dispatcher and a Runner per
// consumer applying through the inbox with the suite's side effect.
type pipeline struct {
	*world
	routing Routing

	enqMu    sync.Mutex
	enqueued []envelope.Envelope
}

func newPipeline(t *testing.T, h Harness, ps Preset) *pipeline {
	t.Helper()
	w := openWorld(t, h)
	p := &pipeline{world: w}
	w.dep, p.routing = h.Preset(t, ps.Name)
	for _, c := range p.routing.Consumers {
		// No fail plan: nothing here fails, and a plan read per
		// application would only load the database.
		w.run(c, w.db.Pool, sideEffect(c, 0, nil), inbox.ConsumerConfig{})
	}
	d, err := outbox.NewDispatcher(w.db.Pool, w.dep.Publisher(), outbox.DispatcherConfig{PollInterval: 10 * time.Millisecond,
		BackoffBase: 50 * time.Millisecond, BackoffCap: time.Second, MaxAttempts: 50, Logger: quietLogger})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return p
}

// enqueue commits evs in one transaction and records them with the
// sequences the outbox assigned.
func (p *pipeline) enqueue(evs ...envelope.Envelope) {
	p.t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, p.db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, evs...) })
	if err != nil {
		p.t.Errorf("enqueue: %v", err)
		return
	}
	ids := make([]string, len(evs))
	for i, e := range evs {
		ids[i] = e.ID
	}
	rows, err := p.db.Pool.Query(ctx, `SELECT event_id::text, aggregate_seq FROM outbox WHERE event_id = ANY($1::uuid[])`, ids)
	if err != nil {
		p.t.Errorf("read back sequences: %v", err)
		return
	}
	seq := map[string]int64{}
	for rows.Next() {
		var id string
		var s int64
		_ = rows.Scan(&id, &s)
		seq[id] = s
	}
	rows.Close()
	for i := range evs {
		evs[i].Sequence = seq[evs[i].ID]
	}
	p.enqMu.Lock()
	p.enqueued = append(p.enqueued, evs...)
	p.enqMu.Unlock()
}

// produce enqueues events of nAgg aggregates, perAgg each, in small random
// transactions spread over about dur, while the dispatcher runs.
func (p *pipeline) produce(nAgg, perAgg int, dur time.Duration, kinds []AggKind) {
	p.t.Helper()
	type agg struct {
		kind AggKind
		id   string
		n    int
	}
	var aggs []*agg
	for i := 0; i < nAgg; i++ {
		k := kinds[i%len(kinds)]
		aggs = append(aggs, &agg{kind: k, id: fmt.Sprintf("%s-%d", k.Type, i)})
	}
	// About total/2 transactions (1-3 events each), paced to end after
	// about dur however long each enqueue takes. Events are drawn from the
	// aggregates not yet complete, so no round is empty.
	pause := dur / time.Duration(max(nAgg*perAgg/2, 1))
	start := time.Now()
	for round := 1; len(aggs) > 0 && !p.t.Failed(); round++ {
		var batch []envelope.Envelope
		for n := 1 + rand.IntN(3); n > 0 && len(aggs) > 0; n-- {
			i := rand.IntN(len(aggs))
			a := aggs[i]
			batch = append(batch, event(a.kind.Type, a.id, a.kind.Events[a.n%len(a.kind.Events)]))
			if a.n++; a.n == perAgg {
				aggs = append(aggs[:i], aggs[i+1:]...)
			}
		}
		p.enqueue(batch...)
		time.Sleep(time.Until(start.Add(time.Duration(round) * pause)))
	}
}

// event is a new event of an aggregate; the outbox numbers it.
func event(aggType, aggID, evType string) envelope.Envelope { return Event(aggType, aggID, evType, 0) }

// expect returns consumer -> the ids of the events routed to it.
func (p *pipeline) expect() map[string]map[string]bool {
	p.enqMu.Lock()
	defer p.enqMu.Unlock()
	want := map[string]map[string]bool{}
	for _, c := range p.routing.Consumers {
		want[c] = map[string]bool{}
	}
	for _, e := range p.enqueued {
		for _, c := range p.routing.Routes(e) {
			want[c][e.ID] = true
		}
	}
	return want
}

// waitAll waits until the consumers applied as many events as were routed
// to them, then checks: nothing else, nothing twice, per-aggregate order.
func (p *pipeline) waitAll(timeout time.Duration) []appliedRow {
	p.t.Helper()
	want := p.expect()
	total := 0
	for _, ids := range want {
		total += len(ids)
	}
	var rows []appliedRow
	deadline := time.Now().Add(timeout)
	for {
		rows = p.applied()
		if len(rows) >= total || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // let strays (a duplicate, a wrong route) arrive
	rows = p.applied()
	checkOnceInOrder(p.t, rows, want)
	return rows
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

// Events reach exactly the consumers their routing selects, each is
// applied once, and each aggregate's events apply in order; every consumer
// gets some of them (the routing selects real traffic).
func testEndToEnd(t *testing.T, h Harness, ps Preset) {
	p := newPipeline(t, h, ps)
	p.produce(40, 8, 2*time.Second, ps.Kinds)
	rows := p.waitAll(60 * time.Second)
	t.Logf("%d events enqueued, %d applications", len(p.enqueued), len(rows))
	per := map[string]int{}
	for _, r := range rows {
		per[r.consumer]++
	}
	for _, c := range p.routing.Consumers {
		if per[c] == 0 {
			t.Errorf("consumer %s applied nothing", c)
		}
	}
}

// Replay re-sends stored events to one consumer: after its inbox rows are
// cleared they apply again, in order, and the other consumer gets nothing.
// A second replay of the same events is not dropped as a duplicate.
func testReplayOneConsumer(t *testing.T, h Harness) {
	p := newPipeline(t, h, Corewrite)
	ctx := context.Background()
	ops := p.dep.Operations()
	p.produce(5, 4, 200*time.Millisecond, Corewrite.Kinds)
	p.waitAll(60 * time.Second)

	// The stored events, ordered by aggregate and sequence (what
	// pkg/redrive's replay selects), with the inbox rows cleared first.
	rows, err := p.db.Pool.Query(ctx, `SELECT event_id::text, event_type, aggregate_type, aggregate_id, aggregate_seq, body
FROM outbox_events WHERE state = 'sent' ORDER BY aggregate_id, aggregate_seq`)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outbox.Message, error) {
		var m outbox.Message
		err := r.Scan(&m.EventID, &m.EventType, &m.AggregateType, &m.GroupID, &m.Sequence, &m.Body)
		m.Attributes = envelope.Envelope{Type: m.EventType, AggregateType: m.AggregateType}.Attributes()
		return m, err
	})
	if err != nil || len(msgs) != 20 {
		t.Fatalf("%d sent events (%v), want 20", len(msgs), err)
	}
	clearInbox := func() {
		if _, err := p.db.Pool.Exec(ctx, `DELETE FROM inbox WHERE consumer = 'search-indexer'`); err != nil {
			t.Fatal(err)
		}
	}
	indexed := func(n int) {
		p.eventually(60*time.Second, fmt.Sprintf("search-indexer to apply %d events", n), func() bool {
			return len(rowsOf(p.applied(), "search-indexer")) == n
		})
	}
	clearInbox()
	before := len(rowsOf(p.applied(), "cache-invalidator"))
	sent, err := ops.Replay(ctx, "search-indexer", msgs)
	if err != nil || sent != 20 {
		t.Fatalf("replay sent %d: %v", sent, err)
	}
	indexed(40)
	time.Sleep(300 * time.Millisecond)
	all := p.applied()
	if n := len(rowsOf(all, "cache-invalidator")); n != before {
		t.Errorf("cache-invalidator applied %d, had %d: the replay reached it", n, before)
	}
	if n := len(rowsOf(all, "search-indexer")); n != 40 {
		t.Errorf("search-indexer applied %d, want 20 + 20 replayed", n)
	}
	// The replayed half is in per-aggregate order.
	last := map[string]int64{}
	for _, r := range rowsOf(all, "search-indexer")[20:] {
		if r.seq <= last[r.agg] {
			t.Errorf("replay applied %s seq %d after %d", r.agg, r.seq, last[r.agg])
		}
		last[r.agg] = r.seq
	}
	clearInbox()
	if sent, err := ops.Replay(ctx, "search-indexer", msgs[:2]); err != nil || sent != 2 {
		t.Fatalf("second replay sent %d: %v", sent, err)
	}
	indexed(42)
	if _, err := ops.Replay(ctx, "nobody", msgs); err == nil {
		t.Error("replay to an unknown consumer was accepted")
	}
	if ok, err := ops.Selects("search-indexer", msgs[0]); !ok || err != nil {
		t.Errorf("Selects: %v %v", ok, err)
	}
}
