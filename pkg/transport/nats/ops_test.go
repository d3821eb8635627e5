package nats_test

import (
	"context"
	"strings"
	"testing"

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
