package amqp

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Runner consumes one consumer's queue on this machine or in a container:
// the local counterpart of the Lambda handler, on the same consumer engine
// (inbox.Engine).
//
// The queue has single active consumer, so with several runners for one
// consumer exactly one applies messages and the others stand by; its order
// is the queue's order. The engine applies different aggregates in
// parallel (Consumer.Workers lanes) and one aggregate's messages one after
// the other, a lane's waiting messages in one inbox transaction. Each
// message is acknowledged only after that transaction committed, or after
// its copy reached a delay queue or the DLQ (publisher-confirmed). When a
// message cannot be settled (the broker refuses the retry or DLQ copy), the
// runner stops settling and reopens its channel, so the broker redelivers
// every unacknowledged message in its original order; the inbox, the parks
// and the holds recognise what was done already. While the database is
// unreachable the engine keeps its messages unacknowledged and retries in
// place: RabbitMQ needs no keep-alive for them (within the broker's
// consumer_timeout, 30 minutes by default, after which it closes the
// channel and redelivers them).
type Runner struct {
	cfg    Config
	engine *inbox.Engine
	c      Consumer
	conn   *connector
	out    *sender
}

var _ transport.Runner = (*Runner)(nil)

// NewRunner returns a Runner for cc.Consumer, applying events with apply
// through the inbox in db.
func NewRunner(cfg Config, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (*Runner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp runner: %w", err)
	}
	r := &Runner{cfg: cfg}
	e, c, err := newEngine(&r.cfg, db, apply, cc)
	if err != nil {
		return nil, fmt.Errorf("new amqp runner: %w", err)
	}
	r.engine, r.c = e, c
	r.out = newSender(&r.cfg, "consumer/"+c.Name+"/settle")
	r.conn = newConnector(&r.cfg, "consumer/"+c.Name)
	return r, nil
}

// Run consumes until ctx is done, reconnecting after broker outages, and
// returns nil then. Messages in hand when ctx ends are finished (within
// HandlerTimeout) and acknowledged, not abandoned. Run closes the runner's
// connections when it returns: call it once.
func (r *Runner) Run(ctx context.Context) error {
	defer r.out.close()
	defer r.conn.close()
	failures := 0
	for ctx.Err() == nil {
		started := time.Now()
		err := r.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if time.Since(started) > time.Minute {
			failures = 0
		}
		failures++
		wait := min(r.cfg.ReconnectDelay<<min(failures-1, 16), r.cfg.ReconnectMaxDelay)
		if err != nil {
			r.cfg.Logger.Warn("amqp consumer: session ended; reconnecting", "consumer", r.c.Name, "retry_in", wait.String(), "error", err.Error())
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
	return nil
}

// session consumes on one channel until it closes, a message cannot be
// settled, or ctx ends.
func (r *Runner) session(ctx context.Context) error {
	conn, _, err := r.conn.get(ctx, time.Hour)
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	// Closing the channel (when the session ends) requeues every
	// unacknowledged message in order.
	defer ch.Close()
	if err := ch.Qos(r.c.Prefetch, 0, false); err != nil {
		return fmt.Errorf("qos: %w", err)
	}
	closed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	tag := fmt.Sprintf("fifobox-%s-%d", r.c.Name, time.Now().UnixNano())
	deliveries, err := ch.Consume(r.c.QueueName(), tag, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %s: %w", r.c.QueueName(), err)
	}
	stuck := make(chan error, 1)
	s := r.engine.Start(ctx, &broker{topo: &r.cfg.Topology, c: r.c, out: r.out, cfg: &r.cfg}, func(err error) {
		select {
		case stuck <- err:
		default:
		}
	})
	for {
		select {
		case <-ctx.Done():
			// Stop deliveries; what the engine has queued finishes.
			_ = ch.Cancel(tag, false)
			s.Stop(true)
			return nil
		case e := <-closed:
			s.Stop(false)
			if e != nil {
				return fmt.Errorf("channel closed: %d %s", e.Code, e.Reason)
			}
			return errors.New("channel closed")
		case err := <-stuck:
			s.Stop(false)
			return fmt.Errorf("%w: %v", errNotSettled, err)
		case m, ok := <-deliveries:
			if !ok {
				s.Stop(false)
				return errors.New("consumer cancelled by the broker (queue deleted?)")
			}
			s.Submit(r.cfg.Topology.record(r.c, fromAMQP(m), m.Body, deliveryCount(m), m.Redelivered))
		}
	}
}

// fromAMQP wraps an AMQP delivery.
func fromAMQP(m amqp091.Delivery) *delivery {
	d := &delivery{messageID: m.MessageId, headers: m.Headers, props: amqp091.Publishing{
		ContentType: m.ContentType, ContentEncoding: m.ContentEncoding, DeliveryMode: m.DeliveryMode,
		Priority: m.Priority, CorrelationId: m.CorrelationId, MessageId: m.MessageId,
		Timestamp: m.Timestamp, Type: m.Type, AppId: m.AppId,
	}}
	if d.messageID == "" {
		d.messageID = fmt.Sprintf("delivery-%d", m.DeliveryTag)
	}
	if d.headers == nil {
		d.headers = amqp091.Table{}
	}
	if m.Acknowledger != nil {
		d.ack = func() error { return m.Ack(false) }
	}
	return d
}

// headerDeliveryCount is a quorum queue's count of a message's earlier
// deliveries, set on each delivery.
const headerDeliveryCount = "x-delivery-count"

// deliveryCount is how often a quorum queue delivered m, this time
// included (x-delivery-count counts the earlier ones); 0 when unknown.
func deliveryCount(m amqp091.Delivery) int {
	if v, ok := m.Headers[headerDeliveryCount]; ok {
		return headerInt(v) + 1
	}
	if m.Redelivered {
		return 0
	}
	return 1
}
