package amqp_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

func TestDepths(t *testing.T) {
	t.Parallel()
	topo := amqp.Ticketing()
	cfg, _ := setup(t, topo)
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
	ops, err := amqp.NewOperations(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()
	eventually(t, 10*time.Second, "depths", func() bool {
		d, err := ops.Depths(ctx)
		return err == nil && len(d) == 2 && d[0].Ready == 4 && d[1].Ready == 3
	})
	d, _ := ops.Depths(ctx, "notification")
	if len(d) != 1 || d[0].Queue != "ticketing.notification" || d[0].DLQ != 0 || d[0].Retrying != 0 || d[0].InFlight != -1 || d[0].Error != "" {
		t.Errorf("notification depth %+v", d)
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
	p := newPipeline(t, amqp.Corewrite())
	ctx := context.Background()
	p.produce(5, 4, 200*time.Millisecond, corewriteKinds)
	p.waitApplied(60 * time.Second)

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
	// The replayed half is in per-aggregate order.
	last := map[string]int64{}
	for _, r := range rowsOf(all, "search-indexer")[20:] {
		if r.seq <= last[r.agg] {
			t.Errorf("replay applied %s seq %d after %d", r.agg, r.seq, last[r.agg])
		}
		last[r.agg] = r.seq
	}
	if _, err := p.ops.Replay(ctx, "nobody", msgs); err == nil {
		t.Error("replay to an unknown consumer was accepted")
	}
}
