package amqp_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// lambdaEvent renders deliveries the way Lambda's Amazon MQ event source
// does (base64 data; string headers as {"bytes": [...]}) and decodes that
// JSON into events.RabbitMQEvent, so the handler sees the real shape.
func lambdaEvent(t *testing.T, queue, vhost string, ds []amqp091.Delivery) events.RabbitMQEvent {
	t.Helper()
	var msgs []map[string]any
	for _, d := range ds {
		headers := map[string]any{}
		for k, v := range d.Headers {
			switch x := v.(type) {
			case string:
				b := make([]int, len(x))
				for i := range x {
					b[i] = int(x[i])
				}
				headers[k] = map[string]any{"bytes": b}
			default:
				headers[k] = x
			}
		}
		msgs = append(msgs, map[string]any{
			"basicProperties": map[string]any{"contentType": d.ContentType, "headers": headers, "deliveryMode": d.DeliveryMode,
				"messageId": d.MessageId, "type": d.Type, "bodySize": len(d.Body)},
			"redelivered": d.Redelivered,
			"data":        base64.StdEncoding.EncodeToString(d.Body),
		})
	}
	raw, err := json.Marshal(map[string]any{"eventSource": "aws:rmq", "eventSourceArn": "arn:aws:mq:us-east-1:123456789012:broker:test:b-1",
		"rmqMessagesByQueue": map[string]any{queue + "::" + vhost: msgs}})
	if err != nil {
		t.Fatal(err)
	}
	var ev events.RabbitMQEvent
	if err := json.Unmarshal(raw, &ev); err != nil {
		t.Fatal(err)
	}
	return ev
}

// TestLambdaHandler: the Amazon MQ event's shape (base64 data, headers as
// {"bytes": [...]}); one bad record neither blocks nor re-applies the rest;
// the handler settles each record itself (delay queue, DLQ); a batch it
// cannot settle fails as a whole and its redelivery is recognised. Delays
// are long so that nothing comes back from a delay queue during the test.
func TestLambdaHandler(t *testing.T) {
	t.Parallel()
	topo := amqp.Ticketing()
	topo.Consumers[0].Retry = transport.RetryPolicy{MaxRetries: 3, InitialDelay: transport.Duration(time.Minute), Multiplier: 2,
		MaxDelay: transport.Duration(10 * time.Minute)}
	cfg, v := setup(t, topo)
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (n bigserial, event_id uuid, seq bigint)`); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	fail := map[string]error{}
	apply := func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
		mu.Lock()
		err := fail[e.ID]
		mu.Unlock()
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `INSERT INTO applied (event_id, seq) VALUES ($1, $2)`, e.ID, e.Sequence)
		return err
	}
	var settled []inbox.Settlement
	h, err := amqp.NewLambdaHandler(cfg, db.Pool, apply, inbox.ConsumerConfig{Consumer: "inventory", OnSettle: func(s inbox.Settlement) {
		mu.Lock()
		settled = append(settled, s)
		mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	pub := newPublisher(t, cfg)
	r := dialRaw(t, v.URL)

	a1 := newEvent("hold", "h-a", "hold.created", 1)
	c1 := newEvent("hold", "h-c", "hold.created", 1)
	c2 := newEvent("hold", "h-c", "hold.expired", 2)
	d1 := newEvent("hold", "h-d", "hold.created", 1)
	mu.Lock()
	fail[c1.ID] = errors.New("inventory db timeout")
	fail[d1.ID] = envelope.Permanent(errors.New("unknown venue"))
	mu.Unlock()
	for _, batch := range [][]envelope.Envelope{{a1, c1, d1}, {c2}} {
		var msgs []outbox.Message
		for _, e := range batch {
			msgs = append(msgs, message(e))
		}
		for _, err := range pub.Publish(ctx, msgs) {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	ch, _ := r.conn.Channel()
	if err := ch.PublishWithContext(ctx, "", "ticketing.inventory", true, false, amqpPublishing("garbage", []byte("not json"))); err != nil {
		t.Fatal(err)
	}
	ch.Close()
	ev := lambdaEvent(t, "ticketing.inventory", v.Name, r.get("ticketing.inventory"))
	if n := len(ev.MessagesByQueue["ticketing.inventory::"+v.Name]); n != 5 {
		t.Fatalf("batch has %d records, want 5", n)
	}

	if err := h.Handle(ctx, ev); err != nil {
		t.Fatalf("a batch with one transient, one permanent and one invalid record failed as a whole: %v", err)
	}
	applied := func() map[string]int {
		rows, _ := db.Pool.Query(ctx, `SELECT event_id::text FROM applied`)
		ids, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		m := map[string]int{}
		for _, id := range ids {
			m[id]++
		}
		return m
	}
	if got := applied(); got[a1.ID] != 1 || len(got) != 1 {
		t.Fatalf("applied %v, want only the good record", got)
	}
	if n := r.depth("ticketing.inventory.dlq"); n != 2 {
		t.Errorf("DLQ holds %d, want the permanent and the invalid record", n)
	}
	// c1 waits for its first retry; c2, of the same hold, waits behind it.
	retryQ := topo.Consumers[0].RetryQueueName(1)
	held := r.get(retryQ)
	if len(held) != 2 || held[0].MessageId != c1.ID || held[1].MessageId != c2.ID || held[0].Headers["x-attempts"] != int32(1) || held[1].Headers["x-attempts"] != int32(0) {
		t.Fatalf("retry queue %s holds %d messages (%v), want c1 (attempt 1) then c2", retryQ, len(held), held)
	}

	// Lambda delivers the same batch again (as after a failed invocation):
	// nothing is applied twice, and c1's second failure counts (its park
	// says it failed once already): it waits for retry 2.
	if err := h.Handle(ctx, ev); err != nil {
		t.Fatal(err)
	}
	if got := applied(); got[a1.ID] != 1 {
		t.Fatalf("redelivered batch re-applied a1: %v", got)
	}
	if again := r.get(topo.Consumers[0].RetryQueueName(2)); len(again) != 2 || again[0].MessageId != c1.ID || again[0].Headers["x-attempts"] != int32(2) {
		t.Fatalf("after the redelivery retry 2's queue holds %v, want c1 (2 failures) then c2", again)
	}

	// A record whose retry cannot be sent (its delay queue is gone) fails the
	// batch, and the later record of the same hold is not applied before it.
	ch, _ = r.conn.Channel()
	for _, q := range []string{retryQ, "ticketing.inventory.dlq"} {
		if _, err := ch.QueuePurge(q, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ch.QueueDelete(retryQ, false, false, false); err != nil {
		t.Fatal(err)
	}
	ch.Close()
	e1 := newEvent("hold", "h-e", "hold.created", 1)
	e2 := newEvent("hold", "h-e", "hold.expired", 2)
	mu.Lock()
	fail[e1.ID] = errors.New("inventory db timeout")
	mu.Unlock()
	if err := pub.Publish(ctx, []outbox.Message{message(e1)})[0]; err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(ctx, []outbox.Message{message(e2)})[0]; err != nil {
		t.Fatal(err)
	}
	ev2 := lambdaEvent(t, "ticketing.inventory", v.Name, r.get("ticketing.inventory"))
	if err := h.Handle(ctx, ev2); err == nil || !errors.Is(err, amqp.ErrUnroutable) {
		t.Fatalf("unsettleable batch returned %v, want an error naming the unroutable retry", err)
	}
	if got := applied(); got[e2.ID] != 0 {
		t.Fatalf("e2 applied while e1 is unsettled")
	}
	// Provisioned again, Lambda's redelivery of the batch settles it: e1's
	// first failure was counted (its settling failed, not the count), so
	// it waits for retry 2, and e2 behind it.
	p, _ := amqp.NewProvisioner(cfg)
	if err := p.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, ev2); err != nil {
		t.Fatal(err)
	}
	if held := r.get(topo.Consumers[0].RetryQueueName(2)); len(held) != 2 || held[0].MessageId != e1.ID || held[1].MessageId != e2.ID {
		t.Fatalf("after redelivery retry 2's queue holds %d messages, want e1 then e2", len(held))
	}
	if err := h.Handle(ctx, events.RabbitMQEvent{MessagesByQueue: map[string][]events.RabbitMQMessage{"other::" + v.Name: nil}}); err == nil {
		t.Error("records from another consumer's queue were accepted")
	}
}
