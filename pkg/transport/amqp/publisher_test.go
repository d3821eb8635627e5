package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

func TestProvisionIsIdempotentAndReportsConflicts(t *testing.T) {
	t.Parallel()
	cfg, v := setup(t, amqp.Holdco())
	ctx := context.Background()
	p, _ := amqp.NewProvisioner(cfg)
	if err := p.Provision(ctx); err != nil {
		t.Fatalf("second provision: %v", err)
	}
	r := dialRaw(t, v.URL)
	for _, q := range []string{"analytics.ingest", "analytics.ingest.dlq", "analytics.ingest.retry.1s", "analytics.ingest.retry.16s", "erp.sync", "notifications.dlq"} {
		if r.depth(q) != 0 {
			t.Errorf("queue %s missing after provisioning", q)
		}
	}
	other := amqp.Holdco()
	other.QueueType = amqp.QueueClassic
	cfg.Topology = other
	p2, err := amqp.NewProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = p2.Provision(ctx)
	if !errors.Is(err, amqp.ErrTopologyConflict) || !strings.Contains(err.Error(), "analytics.ingest") {
		t.Fatalf("provisioning classic queues over quorum ones: %v, want ErrTopologyConflict naming the queue", err)
	}
}

func TestPublishRoutesByHoldcoBindings(t *testing.T) {
	t.Parallel()
	cfg, v := setup(t, amqp.Holdco())
	pub := newPublisher(t, cfg)
	msgs := []outbox.Message{
		message(newEvent("invoice", "inv-1", "paid", 1)),
		message(newEvent("order", "ord-1", "created", 1)),
		message(newEvent("payment_intent", "pi-1", "failed", 1)),
		message(newEvent("payment_intent", "pi-2", "succeeded", 1)),
		message(newEvent("customer", "cus-1", "updated", 1)),
	}
	for i, err := range pub.Publish(context.Background(), msgs) {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	r := dialRaw(t, v.URL)
	want := map[string][]string{
		"analytics.ingest": {"invoice.paid", "order.created", "payment_intent.failed", "payment_intent.succeeded", "customer.updated"},
		"erp.sync":         {"invoice.paid", "payment_intent.failed", "payment_intent.succeeded"},
		"notifications":    {"order.created", "payment_intent.failed"},
	}
	for q, keys := range want {
		got := r.get(q)
		var gotKeys []string
		for _, d := range got {
			gotKeys = append(gotKeys, d.RoutingKey)
		}
		if strings.Join(gotKeys, ",") != strings.Join(keys, ",") {
			t.Errorf("%s got %v, want %v", q, gotKeys, keys)
		}
		for _, d := range got {
			if d.DeliveryMode != 2 || d.MessageId == "" || d.ContentType != "application/json" {
				t.Errorf("%s: message not persistent JSON with an id: mode %d id %q type %q", q, d.DeliveryMode, d.MessageId, d.ContentType)
			}
			for _, h := range []string{"x-event-id", "x-aggregate-type", "x-aggregate-id", "x-event-type", "x-attempts", "x-tenant-id"} {
				if _, ok := d.Headers[h]; !ok {
					t.Errorf("%s: header %s missing: %v", q, h, d.Headers)
				}
			}
			if d.Headers["x-event-id"] != d.MessageId {
				t.Errorf("x-event-id %v != message id %s", d.Headers["x-event-id"], d.MessageId)
			}
		}
	}
}

// TestPublishOutcomes pins the documented outcome of each failure.
func TestPublishOutcomes(t *testing.T) {
	t.Parallel()
	topo := amqp.Ticketing()
	topo.Consumers[1].MaxLength = 1 // notification: room for one message
	cfg, v := setup(t, topo)
	pub := newPublisher(t, cfg)
	ctx := context.Background()
	r := dialRaw(t, v.URL)

	publish := func(m outbox.Message) error { return pub.Publish(ctx, []outbox.Message{m})[0] }

	// No consumer selects refund.issued: delivered under the default
	// policy (TestUnroutedPolicy has the rest).
	if err := publish(message(newEvent("refund", "r-1", "refund.issued", 1))); err != nil {
		t.Errorf("an event no consumer selects: %v, want delivered", err)
	}

	// Full queue: order.cancelled goes to notification only, bounded to one
	// message with reject-publish. The broker nacks once the queue is full:
	// retryable. (A quorum queue enforces the bound from the publish after
	// the one that filled it, so allow one more accepted message.)
	var nacked error
	for i := 0; i < 3 && nacked == nil; i++ {
		nacked = publish(message(newEvent("order", fmt.Sprintf("o-%d", i), "order.cancelled", 1)))
	}
	if !errors.Is(nacked, amqp.ErrNacked) || envelope.IsPermanent(nacked) {
		t.Errorf("full queue: %v, want retryable ErrNacked", nacked)
	}
	// Routed to two queues, one of them full: nacked as a whole (inventory
	// may hold a copy; the retry then gives it a duplicate the inbox drops).
	err := publish(message(newEvent("order", "o-3", "order.confirmed", 1)))
	if !errors.Is(err, amqp.ErrNacked) {
		t.Errorf("one of two queues full: %v, want ErrNacked", err)
	}
	r.get("ticketing.notification")
	eventually(t, 10*time.Second, "the drained queue to accept again", func() bool {
		return publish(message(newEvent("order", "o-2", "order.cancelled", 1))) == nil
	})

	// Deleted queue: with notification gone, order.cancelled, which the
	// topology routes to it, has no route: retryable.
	ch, _ := r.conn.Channel()
	if _, err := ch.QueueDelete("ticketing.notification", false, false, false); err != nil {
		t.Fatal(err)
	}
	ch.Close()
	err = publish(message(newEvent("order", "o-4", "order.cancelled", 1)))
	if !errors.Is(err, amqp.ErrUnroutable) || envelope.IsPermanent(err) {
		t.Errorf("deleted queue: %v, want retryable ErrUnroutable", err)
	}
	// ...and provisioning again repairs it.
	p, _ := amqp.NewProvisioner(cfg)
	if err := p.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := publish(message(newEvent("order", "o-4", "order.cancelled", 1))); err != nil {
		t.Errorf("after re-provisioning: %v", err)
	}

	// Permanent: a body over MaxMessageBytes, a routing key over 255 bytes.
	small := cfg
	small.MaxMessageBytes = 1024
	sp := newPublisher(t, small)
	big := message(newEvent("order", "o-5", "order.confirmed", 1))
	big.Body = append(big.Body, make([]byte, 2000)...)
	if err := sp.Publish(ctx, []outbox.Message{big})[0]; !envelope.IsPermanent(err) || !errors.Is(err, amqp.ErrTooLarge) {
		t.Errorf("too large: %v, want permanent ErrTooLarge", err)
	}
	long := message(newEvent("order", "o-6", "order.confirmed", 1))
	long.EventType = "order." + strings.Repeat("x", 260)
	if err := publish(long); !envelope.IsPermanent(err) || !errors.Is(err, amqp.ErrRoutingKey) {
		t.Errorf("long routing key: %v, want permanent ErrRoutingKey", err)
	}

	// Missing exchange: the broker closes the channel (404); retryable, and
	// the publisher opens a fresh channel for the next call.
	gone := cfg
	gone.Topology = amqp.Ticketing()
	gone.Topology.Exchange.Name = "no.such.exchange"
	gp := newPublisher(t, gone)
	err = gp.Publish(ctx, []outbox.Message{message(newEvent("order", "o-7", "order.confirmed", 1))})[0]
	if !errors.Is(err, amqp.ErrConfirmLost) || envelope.IsPermanent(err) || !strings.Contains(err.Error(), "404") {
		t.Errorf("missing exchange: %v, want retryable ErrConfirmLost naming 404", err)
	}
	if err := publish(message(newEvent("order", "o-8", "order.confirmed", 1))); err != nil {
		t.Errorf("the good publisher after another's channel error: %v", err)
	}
}

func TestPublishNeverSendsAnAggregatesSecondMessageBeforeTheFirstIsConfirmed(t *testing.T) {
	t.Parallel()
	cfg, v := setup(t, amqp.Ticketing())
	pub := newPublisher(t, cfg)
	r := dialRaw(t, v.URL)
	// Two of one aggregate in one call (the dispatcher never does this): the
	// first is unroutable (its only queue is gone), so the second must not
	// be sent.
	ch, _ := r.conn.Channel()
	if _, err := ch.QueueDelete("ticketing.inventory", false, false, false); err != nil {
		t.Fatal(err)
	}
	ch.Close()
	first := message(newEvent("hold", "h-1", "hold.created", 1))
	second := message(newEvent("hold", "h-1", "order.cancelled", 2))
	other := message(newEvent("order", "o-1", "order.cancelled", 1))
	errs := pub.Publish(context.Background(), []outbox.Message{first, second, other})
	if !errors.Is(errs[0], amqp.ErrUnroutable) || !errors.Is(errs[1], amqp.ErrPredecessorFailed) || errs[2] != nil {
		t.Fatalf("got %v", errs)
	}
	if got := r.get("ticketing.notification"); len(got) != 1 || got[0].MessageId != other.EventID {
		t.Fatalf("notification got %d messages, want only the other aggregate's", len(got))
	}
}

func TestPublisherReconnects(t *testing.T) {
	t.Parallel()
	cfg, v := setup(t, amqp.Corewrite())
	pub := newPublisher(t, cfg)
	ctx := context.Background()
	if err := pub.Publish(ctx, []outbox.Message{message(newEvent("doc", "d-1", "doc.written", 1))})[0]; err != nil {
		t.Fatal(err)
	}
	v.CloseConnections(t)
	// The first call after the drop may still see the dead connection; a
	// later one must succeed without anyone restarting the publisher.
	deadline := time.Now().Add(30 * time.Second)
	var err error
	for seq := int64(2); time.Now().Before(deadline); seq++ {
		if err = pub.Publish(ctx, []outbox.Message{message(newEvent("doc", "d-1", "doc.written", seq))})[0]; err == nil {
			break
		}
		if envelope.IsPermanent(err) {
			t.Fatalf("a dropped connection gave a permanent error: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("publisher did not recover: %v", err)
	}
}
