package amqp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/inbox"
)

// newEngine is the consumer engine for cc.Consumer with the topology's
// lanes (Workers) and retry policy. RabbitMQ redelivers a retried message
// through a delay queue, at the tail of the consumer's queue, so a record
// waiting behind its group's retrying head is sent to the head's delay
// queue too (they come back in order): no HoldDeferred.
func newEngine(cfg *Config, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (*inbox.Engine, Consumer, error) {
	c, ok := cfg.Topology.Consumer(cc.Consumer)
	if !ok {
		return nil, Consumer{}, fmt.Errorf("consumer %q is not in the topology", cc.Consumer)
	}
	if cc.Logger == nil {
		cc.Logger = cfg.Logger
	}
	e, err := inbox.NewEngine(db, apply, inbox.EngineConfig{ConsumerConfig: cc, Lanes: c.Workers,
		MaxRetries: c.Retry.MaxRetries, RetryDelay: c.Retry.Delay})
	if err != nil {
		return nil, Consumer{}, err
	}
	return e, c, nil
}

// delivery is one message as delivered, from AMQP or from a Lambda event:
// the inbox.Record's Handle.
type delivery struct {
	messageID string
	headers   amqp091.Table
	props     amqp091.Publishing // properties to keep when re-publishing (no body, no headers)
	// ack acknowledges the delivery on its channel (nil: Lambda settles
	// the whole invocation itself).
	ack func() error
}

// record wraps d and its body for c's engine. redelivered is RabbitMQ's
// flag: an earlier delivery was not acknowledged (a consumer died or lost
// its connection holding it); the engine runs such a record alone.
//
// A quorum queue dead-letters a message itself, without the engine, when
// it comes back after its delivery_limit-th redelivery (x-delivery-count
// counts them; RabbitMQ 3.10 and 4.x alike). On the delivery before that
// the record is marked LastDelivery: in strict order the engine holds its
// group in the database before running it, so if the consumer dies on it
// again and the broker dead-letters it, the group's later events still
// wait behind it (and follow it to the DLQ) instead of being applied
// first.
func (t *Topology) record(c Consumer, d *delivery, body []byte, deliveries int, redelivered bool) *inbox.Record {
	return &inbox.Record{ID: d.messageID, Body: body, Failures: headerInt(d.headers[t.AttemptsHeader]),
		Deliveries: deliveries, Redelivered: redelivered, LastDelivery: c.lastDelivery(d.headers), Handle: d}
}

// lastDelivery says a message with these headers is on its last delivery
// before the queue's delivery limit dead-letters it.
func (c Consumer) lastDelivery(h amqp091.Table) bool {
	n, ok := h[headerDeliveryCount]
	return ok && c.DeliveryLimit > 0 && headerInt(n) >= c.DeliveryLimit
}

// broker settles records on RabbitMQ for the engine: acknowledge, retry
// through the consumer's delay queues, dead-letter to its DLQ, both sent
// through the consumer's own settle exchange. Retry and dead-letter copies are publisher-confirmed before the
// original is acknowledged, so a crash in between leaves a copy twice,
// never none (the inbox and the parks recognise the copy).
type broker struct {
	topo *Topology
	c    Consumer
	out  *sender
	cfg  *Config
}

var _ inbox.Broker = (*broker)(nil)

func (b *broker) Ack(_ context.Context, r *inbox.Record) error {
	d := r.Handle.(*delivery)
	if d.ack == nil {
		return nil
	}
	return d.ack()
}

// Retry sends r to the delay queue of retry rt.N (the head's, for a record
// waiting behind it) with the attempts header set to its failures, then
// acknowledges it.
func (b *broker) Retry(ctx context.Context, r *inbox.Record, rt inbox.Retry) error {
	if b.c.Retry.MaxRetries < 1 {
		return fmt.Errorf("consumer %s has no delay queues (max_retries 0)", b.c.Name)
	}
	n := min(max(rt.N, 1), b.c.Retry.MaxRetries)
	d := r.Handle.(*delivery)
	h := copyHeaders(d.headers, true)
	h[b.topo.AttemptsHeader] = int32(rt.Failures)
	q := b.c.RetryQueueName(n)
	if err := b.out.sendOne(ctx, outgoing{exchange: b.c.SettleExchange(), key: q, msg: republish(d, r.Body, h)}); err != nil {
		return fmt.Errorf("send to delay queue %s: %w", q, err)
	}
	return b.Ack(ctx, r)
}

// DeadLetter sends r to the consumer's DLQ through its settle exchange
// (the only one its broker user may write), with the reason in
// x-fifobox-error-* headers, then acknowledges it.
func (b *broker) DeadLetter(ctx context.Context, r *inbox.Record, dl inbox.DeadLetter) error {
	d := r.Handle.(*delivery)
	h := copyHeaders(d.headers, false)
	h[HeaderErrorClass] = dl.Class
	h[HeaderErrorReason] = dl.Reason
	h[HeaderConsumer] = b.c.Name
	h[HeaderDeadAt] = time.Now().UTC().Format(time.RFC3339Nano)
	if dl.Class != inbox.ClassHeld && dl.Class != inbox.ClassInvalid {
		h[b.topo.AttemptsHeader] = int32(max(dl.Failures-1, 0))
	}
	if err := b.out.sendOne(ctx, outgoing{exchange: b.c.SettleExchange(), key: b.c.DLQName(), msg: republish(d, r.Body, h)}); err != nil {
		return fmt.Errorf("send to DLQ %s: %w", b.c.DLQName(), err)
	}
	return b.Ack(ctx, r)
}

// errNotSettled: a message could not be settled; the session ends so that
// the broker redelivers every unacknowledged message in order.
var errNotSettled = errors.New("amqp consumer: a message could not be settled; redelivering from it")

// republish is d with body as a persistent message with headers h.
func republish(d *delivery, body []byte, h amqp091.Table) amqp091.Publishing {
	p := d.props
	p.Headers = h
	p.Body = body
	p.DeliveryMode = amqp091.Persistent
	if p.MessageId == "" {
		p.MessageId = d.messageID
	}
	return p
}

// copyHeaders copies h; dropDeath leaves out the broker's x-death history
// (it restarts with the next dead-lettering) and the client-set
// x-first-death / x-last-death summaries.
func copyHeaders(h amqp091.Table, dropDeath bool) amqp091.Table {
	out := make(amqp091.Table, len(h)+4)
	for k, v := range h {
		if dropDeath && (k == "x-death" || strings.HasPrefix(k, "x-first-death-") || strings.HasPrefix(k, "x-last-death-")) {
			continue
		}
		out[k] = v
	}
	return out
}

// headerInt reads an integer header however it was encoded (AMQP integer
// types, a JSON number from a Lambda event, a string).
func headerInt(v any) int {
	switch x := v.(type) {
	case int8:
		return int(x)
	case int16:
		return int(x)
	case int32:
		return int(x)
	case int64:
		return int(x)
	case int:
		return x
	case uint8:
		return int(x)
	case uint16:
		return int(x)
	case uint32:
		return int(x)
	case float64:
		if x >= 0 && x < math.MaxInt32 {
			return int(x)
		}
	case string:
		n, _ := strconv.Atoi(x)
		return n
	case []byte:
		n, _ := strconv.Atoi(string(x))
		return n
	}
	return 0
}
