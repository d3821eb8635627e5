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
// the local counterpart of the Lambda handler, with the same settling.
//
// The queue has single active consumer, so with several runners for one
// consumer exactly one applies messages and the others stand by; its order
// is the queue's order. Within the runner, Lanes apply different aggregates
// in parallel (Consumer.Workers at once) and one aggregate's messages one
// after the other. Each message is acknowledged only after the inbox
// transaction committed, or after its copy reached a delay queue or the DLQ
// (publisher-confirmed). When a message cannot be settled (the broker
// refuses the retry or DLQ copy), the runner stops settling and reopens its
// channel, so the broker redelivers every unacknowledged message in its
// original order; the inbox drops the ones already applied.
type Runner struct {
	cfg  Config
	s    *settler
	conn *connector
	out  *sender
}

var _ transport.Runner = (*Runner)(nil)

// NewRunner returns a Runner for cc.Consumer, applying events with apply
// through the inbox in db.
func NewRunner(cfg Config, db inbox.DB, apply inbox.Apply, cc ConsumerConfig) (*Runner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp runner: %w", err)
	}
	r := &Runner{cfg: cfg}
	r.out = newSender(&r.cfg, "consumer/"+cc.Consumer+"/settle")
	s, err := newSettler(&r.cfg, db, apply, cc, r.out)
	if err != nil {
		return nil, fmt.Errorf("new amqp runner: %w", err)
	}
	r.s = s
	r.conn = newConnector(&r.cfg, "consumer/"+cc.Consumer)
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
			r.cfg.Logger.Warn("amqp consumer: session ended; reconnecting", "consumer", r.s.c.Name, "retry_in", wait.String(), "error", err.Error())
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
	defer ch.Close()
	if err := ch.Qos(r.s.c.Prefetch, 0, false); err != nil {
		return fmt.Errorf("qos: %w", err)
	}
	closed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	tag := fmt.Sprintf("fifobox-%s-%d", r.s.c.Name, time.Now().UnixNano())
	deliveries, err := ch.Consume(r.s.c.QueueName(), tag, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("consume %s: %w", r.s.c.QueueName(), err)
	}
	lanes := transport.NewLanes(r.s.c.Workers, r.s.c.Prefetch)
	defer lanes.Close()
	batches := r.s.newBatcher(lanes)
	stuck := make(chan struct{}, 1)
	for {
		select {
		case <-ctx.Done():
			// Stop deliveries; what is queued on the lanes finishes (Close).
			_ = ch.Cancel(tag, false)
			return nil
		case e := <-closed:
			if e != nil {
				return fmt.Errorf("channel closed: %d %s", e.Code, e.Reason)
			}
			return errors.New("channel closed")
		case <-stuck:
			// Closing the channel (deferred) requeues every unacknowledged
			// message in order.
			return errors.New("a message could not be settled; redelivering from it")
		case m, ok := <-deliveries:
			if !ok {
				return errors.New("consumer cancelled by the broker (queue deleted?)")
			}
			err := batches.submit(ctx, fromAMQP(m), func() error { return m.Ack(false) }, func(error) {
				select {
				case stuck <- struct{}{}:
				default:
				}
			})
			if err != nil {
				return nil // ctx ended while the lane was full; the message is redelivered
			}
		}
	}
}

// fromAMQP wraps an AMQP delivery and decodes its body.
func fromAMQP(m amqp091.Delivery) *delivery {
	d := &delivery{messageID: m.MessageId, body: m.Body, headers: m.Headers, props: amqp091.Publishing{
		ContentType: m.ContentType, ContentEncoding: m.ContentEncoding, DeliveryMode: m.DeliveryMode,
		Priority: m.Priority, CorrelationId: m.CorrelationId, MessageId: m.MessageId,
		Timestamp: m.Timestamp, Type: m.Type, AppId: m.AppId,
	}}
	if d.headers == nil {
		d.headers = amqp091.Table{}
	}
	d.decode()
	return d
}
