package nats_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
)

func TestDepths(t *testing.T) {
	t.Parallel()
	cfg := setup(t, nats.Ticketing())
	ctx := context.Background()
	pub := newPublisher(t, cfg)
	for i := 0; i < 3; i++ {
		if err := pub.Publish(ctx, []outbox.Message{message(newEvent("order", "o-1", "order.confirmed", int64(i+1)))})[0]; err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Publish(ctx, []outbox.Message{message(newEvent("hold", "h-1", "hold.created", 1))})[0]; err != nil {
		t.Fatal(err)
	}
	ops, err := nats.NewOperations(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()
	d, err := ops.Depths(ctx)
	if err != nil || len(d) != 2 {
		t.Fatalf("depths %+v: %v", d, err)
	}
	// inventory selects all 4, notification the 3 order.confirmed; on a
	// server before 2.10 each consumer's pending counts the whole stream.
	if d[0].Ready != 4 || (d[1].Ready != 3 && d[1].Ready != 4) {
		t.Errorf("ready: inventory %d, notification %d", d[0].Ready, d[1].Ready)
	}
	if d[1].Consumer != "notification" || d[1].Queue != cfg.Topology.Stream+"/notification" || d[1].DLQ != 0 || d[1].InFlight != 0 || d[1].Error != "" {
		t.Errorf("notification depth %+v", d[1])
	}
	if d, err := ops.Depths(ctx, "nobody"); err != nil || len(d) != 1 || d[0].QueueState != transport.StateMissing || !strings.Contains(d[0].Error, "not in the topology") {
		t.Errorf("an unknown consumer: %+v %v, want it reported missing", d, err)
	}
}

// TestReplayOneConsumer re-sends stored events to one consumer: after its
// inbox rows are cleared they apply again, in order, and the other consumer
// gets nothing.
func TestReplayOneConsumer(t *testing.T) {
	t.Parallel()
	p := newPipeline(t, nats.Corewrite())
	ctx := context.Background()
	p.produce(5, 4, 200*time.Millisecond, corewriteKinds)
	p.waitApplied(60 * time.Second)

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
	if _, err := p.db.Pool.Exec(ctx, `DELETE FROM inbox WHERE consumer = 'search-indexer'`); err != nil {
		t.Fatal(err)
	}
	before := len(rowsOf(p.applied(), "cache-invalidator"))
	sent, err := p.ops.Replay(ctx, "search-indexer", msgs)
	if err != nil || sent != 20 {
		t.Fatalf("replay sent %d: %v", sent, err)
	}
	waitRows(t, p, func(rows []appliedRow) bool { return len(rowsOf(rows, "search-indexer")) == 40 })
	time.Sleep(300 * time.Millisecond)
	all := p.applied()
	if n := len(rowsOf(all, "cache-invalidator")); n != before {
		t.Errorf("cache-invalidator applied %d, had %d: the replay reached it", n, before)
	}
	if n := len(rowsOf(all, "search-indexer")); n != 40 {
		t.Errorf("search-indexer applied %d, want 20 + 20 replayed", n)
	}
	last := map[string]int64{}
	for _, r := range rowsOf(all, "search-indexer")[20:] {
		if r.seq <= last[r.agg] {
			t.Errorf("replay applied %s seq %d after %d", r.agg, r.seq, last[r.agg])
		}
		last[r.agg] = r.seq
	}
	// A second replay of the same events is not dropped as a duplicate.
	if _, err := p.db.Pool.Exec(ctx, `DELETE FROM inbox WHERE consumer = 'search-indexer'`); err != nil {
		t.Fatal(err)
	}
	if sent, err := p.ops.Replay(ctx, "search-indexer", msgs[:2]); err != nil || sent != 2 {
		t.Fatalf("second replay sent %d: %v", sent, err)
	}
	waitRows(t, p, func(rows []appliedRow) bool { return len(rowsOf(rows, "search-indexer")) == 42 })
	if _, err := p.ops.Replay(ctx, "nobody", msgs); err == nil {
		t.Error("replay to an unknown consumer was accepted")
	}
	if ok, err := p.ops.Selects("search-indexer", msgs[0]); !ok || err != nil {
		t.Errorf("Selects: %v %v", ok, err)
	}
}
