package amqp_test

import (
	"context"
	"strings"
	"testing"
	"time"

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
