package amqp_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// What only RabbitMQ has: the dead-letter copies' x-fifobox-* headers (the
// class and reason of each kind of dead letter, the consumer, the attempts
// header), in the order the events died. The behaviour itself (holds,
// retries, redrive) is the conformance suite's.
func TestDeadLetterCopiesCarryTheReason(t *testing.T) {
	t.Parallel()
	topo := amqp.Corewrite()
	for i := range topo.Consumers {
		topo.Consumers[i].Retry = fastRetry(2)
	}
	cfg, v := setup(t, topo)
	db := pgtest.New(t)
	ctx := context.Background()
	rejected, behind, busy := newEvent("doc", "d-1", "doc.written", 1), newEvent("doc", "d-1", "doc.deleted", 2), newEvent("doc", "d-2", "doc.written", 1)
	r, err := amqp.NewRunner(cfg, db.Pool, func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		switch e.ID {
		case rejected.ID:
			return envelope.Permanent(errors.New("document schema not supported"))
		case busy.ID:
			return errors.New("index busy")
		}
		return nil
	}, inbox.ConsumerConfig{Consumer: "search-indexer", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	defer func() { cancel(); <-done }()

	pub := newPublisher(t, cfg)
	for _, e := range []envelope.Envelope{rejected, behind, busy} {
		if err := pub.Publish(ctx, []outbox.Message{message(e)})[0]; err != nil {
			t.Fatal(err)
		}
	}
	raw := dialRaw(t, v.URL)
	ch, _ := raw.conn.Channel()
	if err := ch.PublishWithContext(ctx, "", "corewrite.search-indexer", true, false, amqpPublishing("not-an-envelope", []byte(`{"v":1,"id":"nope"}`))); err != nil {
		t.Fatal(err)
	}
	ch.Close()
	eventually(t, 30*time.Second, "four dead letters", func() bool { return raw.depth("corewrite.search-indexer.dlq") == 4 })

	want := map[string]struct {
		class, reason string
		attempts      any
	}{
		rejected.ID:       {inbox.ClassPermanent, "document schema not supported", int32(0)},
		behind.ID:         {inbox.ClassHeld, "held: waits for event " + rejected.ID, int32(0)},
		busy.ID:           {inbox.ClassExhausted, "failed after 2 retries: index busy", int32(2)},
		"not-an-envelope": {inbox.ClassInvalid, "", nil},
	}
	var order []string
	for _, m := range raw.get("corewrite.search-indexer.dlq") {
		order = append(order, m.MessageId)
		w, ok := want[m.MessageId]
		if !ok {
			t.Errorf("unexpected dead letter %s", m.MessageId)
			continue
		}
		reason, _ := m.Headers[amqp.HeaderErrorReason].(string)
		if m.Headers[amqp.HeaderErrorClass] != w.class || !strings.Contains(reason, w.reason) || m.Headers[amqp.HeaderConsumer] != "search-indexer" {
			t.Errorf("%s: class %v reason %q consumer %v, want %s containing %q", m.MessageId, m.Headers[amqp.HeaderErrorClass], reason, m.Headers[amqp.HeaderConsumer], w.class, w.reason)
		}
		if w.attempts != nil && m.Headers["x-attempts"] != w.attempts {
			t.Errorf("%s: x-attempts %v (%T), want %v", m.MessageId, m.Headers["x-attempts"], m.Headers["x-attempts"], w.attempts)
		}
	}
	if len(order) != 4 || order[0] != rejected.ID || order[1] != behind.ID {
		t.Errorf("dead letters in order %v, want the rejected event, then the one held behind it", order)
	}
}
