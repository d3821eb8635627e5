package amqp_test

import (
	"context"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// The shared dead-letter suite on RabbitMQ quorum queues.
func TestDLQControl(t *testing.T) {
	t.Parallel()
	transporttest.ExerciseDLQ(t, func(t *testing.T) transporttest.DLQHarness {
		topo := amqp.Ticketing()
		cfg, v := setup(t, topo)
		c := topo.Consumers[0]
		ops, err := amqp.NewOperations(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ops.Close() })
		r := dialRaw(t, v.URL)
		return transporttest.DLQHarness{Ops: ops, Consumer: c.Name, WholeGroups: true,
			Kill: func(t *testing.T, evs []envelope.Envelope) {
				ch, err := r.conn.Channel()
				if err != nil {
					t.Fatal(err)
				}
				defer ch.Close()
				if err := ch.Confirm(false); err != nil {
					t.Fatal(err)
				}
				for _, e := range evs {
					body, _ := e.Encode()
					// What the consumer's settler sends to its DLQ.
					p := amqpPublishing(e.ID, body)
					p.Headers = amqp091.Table{amqp.HeaderErrorClass: "permanent", amqp.HeaderErrorReason: "cannot apply it",
						amqp.HeaderConsumer: c.Name, amqp.HeaderDeadAt: time.Now().UTC().Format(time.RFC3339Nano)}
					conf, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", c.DLQName(), true, false, p)
					if err != nil {
						t.Fatal(err)
					}
					if ok, err := conf.WaitContext(context.Background()); !ok || err != nil {
						t.Fatalf("DLQ publish not confirmed: %v", err)
					}
				}
			},
			Queue: func(t *testing.T) []envelope.Envelope {
				var out []envelope.Envelope
				for _, d := range r.get(c.QueueName()) {
					e, err := envelope.Decode(d.Body)
					if err != nil {
						t.Fatalf("queue holds an invalid message: %v", err)
					}
					out = append(out, e)
				}
				return out
			},
		}
	})
}
