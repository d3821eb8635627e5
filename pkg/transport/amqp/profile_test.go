package amqp_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/wire"
)

// profileConfig is a config for profile name on a fresh vhost.
func profileConfig(t *testing.T, name string) (amqp.Config, *amqptest.Vhost) {
	t.Helper()
	p, err := wire.Load(name)
	if err != nil {
		t.Fatal(err)
	}
	m, err := p.Mapper(wire.TransportRabbitMQ)
	if err != nil {
		t.Fatal(err)
	}
	v := amqptest.New(t)
	return amqp.Config{URL: v.URL, Topology: amqp.Holdco(), Wire: m, Logger: quiet, ReconnectMaxDelay: 500 * time.Millisecond}, v
}

func provisionProfile(t *testing.T, cfg amqp.Config) error {
	t.Helper()
	p, err := amqp.NewProfileProvisioner(cfg, amqp.Rabbitmqctl{})
	if err != nil {
		t.Fatal(err)
	}
	p.PolicyWait = 3 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return p.Provision(ctx)
}

// After provisioning, each queue can be declared the way the system's own
// consumers declare it (amqplib's assertQueue(name, {durable: true}) is a
// durable classic queue without arguments; the ticketing PRD's queues
// carry its dead-letter arguments) without a 406, and provisioning again
// changes nothing.
func TestProfileQueuesAcceptTheDocumentsDeclares(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"holdco", "corewrite", "ticketing"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg, v := profileConfig(t, name)
			if err := provisionProfile(t, cfg); err != nil {
				t.Fatal(err)
			}
			if err := provisionProfile(t, cfg); err != nil {
				t.Fatalf("second provision: %v", err)
			}
			r := dialRaw(t, v.URL)
			for _, q := range cfg.Wire.Profile().RabbitMQ.Queues {
				var args amqp091.Table
				if name == "ticketing" && !strings.HasSuffix(q.Name, ".dlq") {
					args = amqp091.Table{"x-dead-letter-exchange": "ticketing.dlx", "x-dead-letter-routing-key": q.Name + ".dlq"}
				}
				ch, err := r.conn.Channel()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := ch.QueueDeclare(q.Name, true, false, false, false, args); err != nil {
					t.Errorf("declaring %s as the document does: %v", q.Name, err)
					continue
				}
				_ = ch.Close()
			}
			if name == "holdco" {
				out := amqptest.Ctl(t, "list_queues", "-p", v.Name, "--no-table-headers", "name", "policy")
				if !strings.Contains(out, "analytics.ingest\tfifobox:analytics.ingest") || !strings.Contains(out, "orders.consumer\tfifobox:orders.consumer") {
					t.Errorf("policies not in effect:\n%s", out)
				}
			}
		})
	}
}

// A queue that exists with other settings is reported with the profile
// field that declares it, and nothing is changed.
func TestProfileProvisionReportsConflicts(t *testing.T) {
	t.Parallel()
	cfg, v := profileConfig(t, "ticketing")
	r := dialRaw(t, v.URL)
	ch, _ := r.conn.Channel()
	if _, err := ch.QueueDeclare("inventory.events", true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	err := provisionProfile(t, cfg)
	if !errors.Is(err, amqp.ErrTopologyConflict) || !strings.Contains(err.Error(), `rabbitmq.queues[0] "inventory.events"`) {
		t.Fatalf("got %v, want ErrTopologyConflict naming rabbitmq.queues[0]", err)
	}
}

// A policy of the user's that outranks the profile's would silently take
// its dead-lettering away: provisioning refuses to finish.
func TestProfileProvisionRefusesAnOutrankedPolicy(t *testing.T) {
	t.Parallel()
	cfg, v := profileConfig(t, "holdco")
	amqptest.Ctl(t, "set_policy", "-p", v.Name, "--priority", "100", "--apply-to", "queues", "users-own", "^analytics", `{"message-ttl": 86400000}`)
	err := provisionProfile(t, cfg)
	if err == nil || !strings.Contains(err.Error(), `queue "analytics.ingest" follows policy "users-own"`) {
		t.Fatalf("got %v", err)
	}
}

// A publisher with a profile sends each event as the profile says: the
// document's body, headers (x-attempts counting the failed publishes
// before this one), message id and timestamp = when the event occurred.
func TestProfilePublisherSendsTheDocumentsMessage(t *testing.T) {
	t.Parallel()
	cfg, v := profileConfig(t, "holdco")
	if err := provisionProfile(t, cfg); err != nil {
		t.Fatal(err)
	}
	pub := newPublisher(t, cfg)
	occurred := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	body := `{"event_id":"0190f5a2-7b3c-7d4e-8f00-123456789abc","occurred_at":"` + occurred.Format(time.RFC3339) + `","aggregate_type":"order",` +
		`"aggregate_id":"o-1","event_type":"created","group_id":"g-1","subsidiary_id":"s-1","payload":{"order_no":"ORD-1"}}`
	e, err := cfg.Wire.Profile().Envelope([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	m := message(e)
	m.Attempt = 3
	for _, err := range pub.Publish(context.Background(), []outbox.Message{m}) {
		if err != nil {
			t.Fatal(err)
		}
	}
	r := dialRaw(t, v.URL)
	for _, q := range []string{"analytics.ingest", "notifications", "orders.consumer"} {
		got := r.get(q)
		if len(got) != 1 {
			t.Fatalf("%s: %d messages", q, len(got))
		}
		d := got[0]
		var b map[string]any
		if err := json.Unmarshal(d.Body, &b); err != nil || b["subsidiary_id"] != "s-1" || b["event_id"] != e.ID {
			t.Errorf("%s body %s", q, d.Body)
		}
		if d.RoutingKey != "order.created" || d.MessageId != e.ID || !d.Timestamp.Equal(occurred) || d.DeliveryMode != 2 {
			t.Errorf("%s: key %q id %q timestamp %v (want %v) mode %d", q, d.RoutingKey, d.MessageId, d.Timestamp, occurred, d.DeliveryMode)
		}
		want := amqp091.Table{"x-event-id": e.ID, "x-aggregate-type": "order", "x-aggregate-id": "o-1", "x-group-id": "g-1",
			"x-subsidiary-id": "s-1", "x-event-type": "created", "x-attempts": int64(2)}
		for k, val := range want {
			if d.Headers[k] != val {
				t.Errorf("%s: header %s = %#v, want %#v", q, k, d.Headers[k], val)
			}
		}
	}
	if n := r.depth("erp.sync"); n != 0 {
		t.Errorf("erp.sync got %d messages for order.created", n)
	}
}

// A stored body that cannot be rendered is a permanent failure of that
// event only.
func TestProfilePublisherRenderErrorIsPermanent(t *testing.T) {
	t.Parallel()
	cfg, _ := profileConfig(t, "ticketing")
	if err := provisionProfile(t, cfg); err != nil {
		t.Fatal(err)
	}
	pub := newPublisher(t, cfg)
	good := message(newEvent("hold", "h-1", "hold.created", 1))
	bad := message(newEvent("hold", "h-2", "hold.created", 1))
	bad.Body = []byte("not json")
	errs := pub.Publish(context.Background(), []outbox.Message{good, bad})
	if errs[0] != nil || !envelope.IsPermanent(errs[1]) {
		t.Fatalf("errors %v", errs)
	}
}

// With a profile, an event none of the profile's queues receives is the
// unrouted one (delivered and reported under the deliver policy), while a
// return for an event a profile queue should receive (the queue deleted)
// stays a retryable failure.
func TestProfilePublisherUnroutedFollowsTheProfile(t *testing.T) {
	t.Parallel()
	cfg, v := profileConfig(t, "ticketing")
	if err := provisionProfile(t, cfg); err != nil {
		t.Fatal(err)
	}
	pub := newPublisher(t, cfg)
	nobody := message(newEvent("order", "o-1", "order.created", 1)) // ticketing binds order.confirmed and order.cancelled only
	if err := pub.Publish(context.Background(), []outbox.Message{nobody})[0]; err != nil {
		t.Fatalf("an event no profile queue receives: %v, want delivered under the deliver policy", err)
	}
	if n := pub.Stats().Unrouted; n != 1 {
		t.Errorf("unrouted count %d, want 1", n)
	}
	r := dialRaw(t, v.URL)
	ch, err := r.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete("inventory.events", false, false, false); err != nil {
		t.Fatal(err)
	}
	err = pub.Publish(context.Background(), []outbox.Message{message(newEvent("hold", "h-1", "hold.created", 1))})[0]
	if !errors.Is(err, amqp.ErrUnroutable) || envelope.IsPermanent(err) {
		t.Fatalf("an event the profile's deleted queue should receive: %v, want retryable ErrUnroutable", err)
	}
}
