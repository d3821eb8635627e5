package amqp_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// syncBuffer collects log output from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestUnroutedPolicy: an event type no consumer binds (ticketing has no
// queue for order.refunded) never holds its aggregate: under the default
// policy it is delivered and reported, under the alternate policy it lands
// in the catch-all queue; the aggregate's next event goes out either way.
func TestUnroutedPolicy(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{"", transport.UnroutedAlternate} {
		t.Run("policy="+policy, func(t *testing.T) {
			t.Parallel()
			topo := amqp.Ticketing()
			topo.Unrouted.Policy = policy
			cfg, v := setup(t, topo)
			logs := &syncBuffer{}
			cfg.Logger = slog.New(slog.NewJSONHandler(logs, nil))
			pub := newPublisher(t, cfg)
			ctx := context.Background()

			refunded := message(newEvent("order", "o-1", "order.refunded", 1))
			cancelled := message(newEvent("order", "o-1", "order.cancelled", 2))
			for i, m := range []outbox.Message{refunded, cancelled} {
				if err := pub.Publish(ctx, []outbox.Message{m})[0]; err != nil {
					t.Fatalf("event %d (%s): %v, want published", i, m.EventType, err)
				}
			}
			if n := pub.Stats().Unrouted; n != 1 {
				t.Errorf("Stats().Unrouted = %d, want 1", n)
			}
			line := ""
			for _, l := range strings.Split(logs.String(), "\n") {
				if strings.Contains(l, transport.UnroutedLogMessage) {
					line = l
				}
			}
			if !strings.Contains(line, refunded.EventID) || !strings.Contains(line, `"unrouted":1`) || strings.Contains(line, "o-1") {
				t.Errorf("unrouted log line %q: want the event id and the count, never the aggregate id", line)
			}
			r := dialRaw(t, v.URL)
			if got := r.get("ticketing.notification"); len(got) != 1 || got[0].MessageId != cancelled.EventID {
				t.Errorf("notification got %d messages, want the aggregate's next event", len(got))
			}
			if policy != transport.UnroutedAlternate {
				if d := r.depth("ticketing.events.unrouted"); d != -1 {
					t.Errorf("deliver policy declared a catch-all queue (depth %d)", d)
				}
				return
			}
			got := r.get("ticketing.events.unrouted")
			if len(got) != 1 || got[0].MessageId != refunded.EventID || got[0].RoutingKey != "order.refunded" {
				t.Fatalf("catch-all queue got %d messages, want order.refunded", len(got))
			}
			// Without its catch-all queue an unrouted event is not lost:
			// retryable until provisioning brings the queue back.
			ch, _ := r.conn.Channel()
			if _, err := ch.QueueDelete(topo.Exchange.Name+".unrouted", false, false, false); err != nil {
				t.Fatal(err)
			}
			ch.Close()
			again := message(newEvent("order", "o-2", "order.refunded", 1))
			if err := pub.Publish(ctx, []outbox.Message{again})[0]; !errors.Is(err, amqp.ErrUnroutable) || envelope.IsPermanent(err) {
				t.Fatalf("catch-all queue deleted: %v, want retryable ErrUnroutable", err)
			}
			p, _ := amqp.NewProvisioner(cfg)
			if err := p.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			if err := pub.Publish(ctx, []outbox.Message{again})[0]; err != nil {
				t.Fatalf("after re-provisioning: %v", err)
			}
		})
	}
}

// TestUnroutedPolicyIsPartOfTheExchange: switching an existing events
// exchange to the alternate policy is a reported conflict, not a silent
// no-op (RabbitMQ compares alternate-exchange on redeclaration).
func TestUnroutedPolicyIsPartOfTheExchange(t *testing.T) {
	t.Parallel()
	cfg, _ := setup(t, amqp.Ticketing())
	cfg.Topology.Unrouted.Policy = transport.UnroutedAlternate
	p, err := amqp.NewProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Provision(context.Background()); !errors.Is(err, amqp.ErrTopologyConflict) {
		t.Fatalf("alternate policy over an existing exchange: %v, want ErrTopologyConflict", err)
	}
}

func TestUnroutedPolicyValidation(t *testing.T) {
	for _, u := range []amqp.Unrouted{{Policy: "drop"}, {Policy: "deliver", Queue: "x"}, {Policy: "alternate", Queue: "amq.x"}} {
		topo := amqp.Ticketing()
		topo.Unrouted = u
		if err := topo.Prepare(); err == nil || !strings.Contains(err.Error(), "unrouted") {
			t.Errorf("%+v: %v, want an error naming unrouted", u, err)
		}
	}
}
