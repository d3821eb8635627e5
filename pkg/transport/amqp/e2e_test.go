package amqp_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
)

// pipeline is the whole flow on the real broker: outbox -> dispatcher ->
// exchange -> one queue per consumer -> a Runner per consumer applying
// through the inbox, each recording what it applied in table applied (in the
// inbox transaction, so a row exists if and only if the event was applied).
type pipeline struct {
	t     *testing.T
	db    *pgtest.DB
	cfg   amqp.Config
	vhost *amqptest.Vhost
	topo  amqp.Topology
	disp  *outbox.Dispatcher
	ops   *amqp.Operations

	mu       sync.Mutex
	fail     func(consumer string, e envelope.Envelope) error // injected side-effect failure
	settled  []inbox.Settlement
	enqueued []envelope.Envelope

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func newPipeline(t *testing.T, topo amqp.Topology) *pipeline {
	t.Helper()
	p := &pipeline{t: t, db: pgtest.New(t), topo: topo}
	p.cfg, p.vhost = setup(t, topo)
	if _, err := p.db.Pool.Exec(context.Background(), `CREATE TABLE applied (n bigserial PRIMARY KEY, consumer text, event_id uuid,
	    aggregate_type text, aggregate_id text, seq bigint, event_type text)`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	t.Cleanup(p.stop)
	for _, c := range topo.Consumers {
		name := c.Name
		apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
			p.mu.Lock()
			fail := p.fail
			p.mu.Unlock()
			if fail != nil {
				if err := fail(name, e); err != nil {
					return err
				}
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied (consumer, event_id, aggregate_type, aggregate_id, seq, event_type) VALUES ($1, $2, $3, $4, $5, $6)`,
				name, e.ID, e.AggregateType, e.AggregateID, e.Sequence, e.Type)
			return err
		}
		r, err := amqp.NewRunner(p.cfg, p.db.Pool, apply, inbox.ConsumerConfig{Consumer: name, OnSettle: func(s inbox.Settlement) {
			p.mu.Lock()
			p.settled = append(p.settled, s)
			p.mu.Unlock()
		}})
		if err != nil {
			t.Fatal(err)
		}
		p.wg.Add(1)
		go func() { defer p.wg.Done(); _ = r.Run(ctx) }()
	}
	pub := newPublisher(t, p.cfg)
	var err error
	p.disp, err = outbox.NewDispatcher(p.db.Pool, pub, outbox.DispatcherConfig{PollInterval: 10 * time.Millisecond,
		BackoffBase: 50 * time.Millisecond, BackoffCap: time.Second, MaxAttempts: 50, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	p.wg.Add(1)
	go func() { defer p.wg.Done(); _ = p.disp.Run(ctx) }()
	p.ops, err = amqp.NewOperations(p.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.ops.Close() })
	return p
}

func (p *pipeline) stop() {
	p.cancel()
	p.wg.Wait()
}

func (p *pipeline) setFail(f func(consumer string, e envelope.Envelope) error) {
	p.mu.Lock()
	p.fail = f
	p.mu.Unlock()
}

// enqueue commits events in one transaction (the outbox numbers them).
func (p *pipeline) enqueue(evs ...envelope.Envelope) []envelope.Envelope {
	p.t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, p.db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, evs...) })
	if err != nil {
		p.t.Errorf("enqueue: %v", err) // Errorf: produce may run on another goroutine
		return nil
	}
	// Read back the sequences the outbox assigned.
	ids := make([]string, len(evs))
	for i, e := range evs {
		ids[i] = e.ID
	}
	rows, err := p.db.Pool.Query(ctx, `SELECT event_id::text, aggregate_seq FROM outbox WHERE event_id = ANY($1::uuid[])`, ids)
	if err != nil {
		p.t.Errorf("read back sequences: %v", err)
		return nil
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
	p.mu.Lock()
	p.enqueued = append(p.enqueued, evs...)
	p.mu.Unlock()
	return evs
}

// produce enqueues events of nAgg aggregates, perAgg each, in small random
// transactions spread over about dur, while the dispatcher runs.
func (p *pipeline) produce(nAgg, perAgg int, dur time.Duration, kinds []aggKind) {
	p.t.Helper()
	type agg struct {
		kind aggKind
		id   string
		n    int
	}
	var aggs []*agg
	for i := 0; i < nAgg; i++ {
		k := kinds[i%len(kinds)]
		aggs = append(aggs, &agg{kind: k, id: fmt.Sprintf("%s-%d", k.typ, i)})
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
			batch = append(batch, newEvent(a.kind.typ, a.id, a.kind.events[a.n%len(a.kind.events)], 0))
			if a.n++; a.n == perAgg {
				aggs = append(aggs[:i], aggs[i+1:]...)
			}
		}
		p.enqueue(batch...)
		time.Sleep(time.Until(start.Add(time.Duration(round) * pause)))
	}
}

// aggKind is an aggregate type and the event types its events cycle through.
type aggKind struct {
	typ    string
	events []string
}

type appliedRow struct {
	n                      int64
	consumer, eventID, agg string
	aggType, eventType     string
	seq                    int64
}

func (p *pipeline) applied() []appliedRow {
	p.t.Helper()
	rows, err := p.db.Pool.Query(context.Background(), `SELECT n, consumer, event_id::text, aggregate_type, aggregate_id, seq, event_type FROM applied ORDER BY n`)
	if err != nil {
		p.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (appliedRow, error) {
		var a appliedRow
		err := r.Scan(&a.n, &a.consumer, &a.eventID, &a.aggType, &a.agg, &a.seq, &a.eventType)
		return a, err
	})
	if err != nil {
		p.t.Fatal(err)
	}
	return out
}

// routes says which consumers an event must reach: topic binding semantics
// (words split on '.', '*' one word, '#' zero or more), fanout: every one.
func (p *pipeline) routes(e envelope.Envelope) []string {
	var out []string
	m := message(e)
	for _, c := range p.topo.Consumers {
		if p.topo.Exchange.Kind == amqp.KindFanout {
			out = append(out, c.Name)
			continue
		}
		if p.topo.Exchange.Kind == amqp.KindHeaders {
			for _, b := range c.Bindings {
				ok := true
				for k, v := range b.Headers {
					ok = ok && m.Attributes[k] == v
				}
				if ok {
					out = append(out, c.Name)
					break
				}
			}
			continue
		}
		key := renderKey(p.topo.RoutingKey, m)
		for _, b := range c.Bindings {
			if topicMatch(strings.Split(b.Key, "."), strings.Split(key, ".")) {
				out = append(out, c.Name)
				break
			}
		}
	}
	return out
}

func renderKey(tpl string, m outbox.Message) string {
	r := strings.NewReplacer("{aggregate_type}", m.AggregateType, "{event_type}", m.EventType, "{aggregate_id}", m.GroupID)
	return r.Replace(tpl)
}

func topicMatch(pat, words []string) bool {
	if len(pat) == 0 {
		return len(words) == 0
	}
	switch pat[0] {
	case "#":
		for i := 0; i <= len(words); i++ {
			if topicMatch(pat[1:], words[i:]) {
				return true
			}
		}
		return false
	case "*":
		return len(words) > 0 && topicMatch(pat[1:], words[1:])
	}
	return len(words) > 0 && words[0] == pat[0] && topicMatch(pat[1:], words[1:])
}

// expect returns consumer -> set of event ids it must apply.
func (p *pipeline) expect() map[string]map[string]bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	want := map[string]map[string]bool{}
	for _, c := range p.topo.Consumers {
		want[c.Name] = map[string]bool{}
	}
	for _, e := range p.enqueued {
		for _, c := range p.routes(e) {
			want[c][e.ID] = true
		}
	}
	return want
}

// waitApplied waits until every consumer applied exactly what its bindings
// select, then checks: nothing else, nothing twice, per-aggregate order.
func (p *pipeline) waitApplied(timeout time.Duration) []appliedRow {
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
	p.checkExactlyOnceInOrder(rows, want)
	return rows
}

func (p *pipeline) checkExactlyOnceInOrder(rows []appliedRow, want map[string]map[string]bool) {
	p.t.Helper()
	seen := map[string]bool{}
	got := map[string]int{}
	last := map[string]int64{}
	for _, r := range rows {
		k := r.consumer + "/" + r.eventID
		if seen[k] {
			p.t.Errorf("%s applied event %s twice", r.consumer, r.eventID)
		}
		seen[k] = true
		if !want[r.consumer][r.eventID] {
			p.t.Errorf("%s applied %s (%s), which its bindings do not select", r.consumer, r.eventID, r.eventType)
		}
		got[r.consumer]++
		ak := r.consumer + "/" + r.aggType + "/" + r.agg
		if r.seq <= last[ak] {
			p.t.Errorf("%s applied %s seq %d after seq %d", r.consumer, r.agg, r.seq, last[ak])
		}
		last[ak] = r.seq
	}
	for c, ids := range want {
		if got[c] != len(ids) {
			p.t.Errorf("%s applied %d events, want %d", c, got[c], len(ids))
		}
	}
}

var (
	holdcoKinds = []aggKind{
		{"invoice", []string{"created", "paid", "voided"}},
		{"order", []string{"created", "shipped", "delivered"}},
		{"payment_intent", []string{"created", "failed", "succeeded"}},
		{"customer", []string{"created", "updated"}},
	}
	ticketingKinds = []aggKind{
		{"hold", []string{"hold.created", "hold.expired"}},
		{"order", []string{"order.confirmed", "order.cancelled"}},
	}
	corewriteKinds = []aggKind{{"doc", []string{"doc.written", "doc.deleted"}}}
	defaultKinds   = []aggKind{
		{"order", []string{"order.created", "order.paid", "order.shipped"}},
		{"customer", []string{"customer.updated"}},
	}
)

func TestEndToEnd(t *testing.T) {
	tests := []struct {
		name  string
		topo  amqp.Topology
		kinds []aggKind
	}{
		{"holdco", amqp.Holdco(), holdcoKinds},
		{"ticketing", amqp.Ticketing(), ticketingKinds},
		{"corewrite", amqp.Corewrite(), corewriteKinds},
		{"default-headers", amqp.FromTopology(topology.Default()), defaultKinds},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p := newPipeline(t, tt.topo)
			p.produce(40, 8, 2*time.Second, tt.kinds)
			rows := p.waitApplied(60 * time.Second)
			t.Logf("%d events enqueued, %d applications", len(p.enqueued), len(rows))
			// Every consumer saw something: the bindings select real traffic.
			per := map[string]int{}
			for _, r := range rows {
				per[r.consumer]++
			}
			for _, c := range tt.topo.Consumers {
				if per[c.Name] == 0 {
					t.Errorf("consumer %s applied nothing", c.Name)
				}
			}
		})
	}
}

// settledFor returns the settlements of one event, in order.
func (p *pipeline) settledFor(consumer, eventID string) []inbox.Settlement {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []inbox.Settlement
	for _, s := range p.settled {
		if s.Consumer == consumer && s.EventID == eventID {
			out = append(out, s)
		}
	}
	return out
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
