package amqp

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Operations are the broker-side operator actions over AMQP alone (no
// management API, which Amazon MQ exposes but not every broker enables).
type Operations struct {
	cfg Config
	out *sender
}

var _ transport.Operations = (*Operations)(nil)

// NewOperations returns Operations for cfg's topology.
func NewOperations(cfg Config) (*Operations, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp operations: %w", err)
	}
	o := &Operations{cfg: cfg}
	o.out = newSender(&o.cfg, "operations")
	return o, nil
}

// Close closes the connection.
func (o *Operations) Close() error { return o.out.close() }

// redriveBatch is how many DLQ messages one redrive step moves (then confirms and acknowledges).
const redriveBatch = 100

func (o *Operations) consumer(name string) (Consumer, error) {
	c, ok := o.cfg.Topology.Consumer(name)
	if !ok {
		return Consumer{}, fmt.Errorf("consumer %q is not in the topology", name)
	}
	return c, nil
}

// Depths reports ready messages (AMQP's queue.declare-ok count; messages
// delivered and not yet acknowledged are not in it, so InFlight is -1),
// messages waiting in the delay queues, the DLQ's depth and the number of
// consumers attached to the queue. A broker that cannot be reached, or a
// queue that does not exist, is reported in the consumer's states and
// Error, not as Depths' error.
func (o *Operations) Depths(ctx context.Context, consumers ...string) ([]transport.QueueDepth, error) {
	names := consumers
	if len(names) == 0 {
		for _, c := range o.cfg.Topology.Consumers {
			names = append(names, c.Name)
		}
	}
	var out []transport.QueueDepth
	conn, _, connErr := o.out.conn.get(ctx, o.cfg.ConnectWait)
	for _, name := range names {
		d := transport.QueueDepth{Consumer: name, Ready: -1, InFlight: -1, DLQ: -1, DLQInFlight: -1, SubscriptionDLQState: transport.StateNone}
		c, err := o.consumer(name)
		switch {
		case err != nil:
			d.QueueState, d.DLQState, d.Error = transport.StateMissing, transport.StateMissing, err.Error()
		case connErr != nil:
			d.QueueState, d.DLQState = transport.StateUnreachable, transport.StateUnreachable
			d.Error = fmt.Sprintf("RabbitMQ %s unreachable: %v", o.endpoint(), connErr)
		default:
			o.depth(conn, c, &d)
		}
		out = append(out, d)
	}
	return out, nil
}

// endpoint is the broker's scheme and host, without credentials.
func (o *Operations) endpoint() string {
	if u, err := url.Parse(o.cfg.URL); err == nil && u.Host != "" {
		return u.Scheme + "://" + u.Host
	}
	return "(broker)"
}

func (o *Operations) depth(conn *amqp091.Connection, c Consumer, d *transport.QueueDepth) {
	d.Queue = c.QueueName()
	var errs []string
	q, err := inspect(conn, c.QueueName())
	d.QueueState = amqpState(err)
	if err != nil {
		errs = append(errs, err.Error())
	} else {
		d.Ready, d.Consumers = int64(q.Messages), q.Consumers
	}
	if q, err := inspect(conn, c.DLQName()); err != nil {
		d.DLQState = amqpState(err)
		errs = append(errs, err.Error())
	} else {
		d.DLQ, d.DLQInFlight, d.DLQState = int64(q.Messages), -1, transport.StateOK
	}
	for _, rq := range c.RetryQueues() {
		if q, err := inspect(conn, rq.Name); err != nil {
			errs = append(errs, err.Error())
		} else {
			d.Retrying += int64(q.Messages)
		}
	}
	d.Error = strings.Join(errs, "; ")
}

// inspect is a passive declare on a channel of its own (a missing queue
// closes the channel).
func inspect(conn *amqp091.Connection, queue string) (amqp091.Queue, error) {
	ch, err := conn.Channel()
	if err != nil {
		return amqp091.Queue{}, fmt.Errorf("%s: %w", queue, err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return amqp091.Queue{}, fmt.Errorf("%s: %w", queue, err)
	}
	return q, nil
}

// amqpState classifies a passive declare's error.
func amqpState(err error) transport.QueueState {
	var ae *amqp091.Error
	switch {
	case err == nil:
		return transport.StateOK
	case errors.As(err, &ae) && ae.Code == amqp091.NotFound:
		return transport.StateMissing
	case errors.Is(err, amqp091.ErrClosed), transport.Unreachable(err):
		return transport.StateUnreachable
	}
	return transport.StateError
}

// Redrive is transport.Operations.Redrive: the consumer's DLQ (the only
// dead-letter queue this transport has) through redrive, or in a dry run
// its depth.
func (o *Operations) Redrive(ctx context.Context, req transport.RedriveRequest) (transport.RedriveResult, error) {
	res := transport.RedriveResult{Waiting: -1, InFlight: -1}
	if req.From != "" && req.From != transport.ConsumerDLQ {
		return res, fmt.Errorf("redrive: %s: %w", req.From, transport.ErrNoSuchDLQ)
	}
	if len(req.Groups)+len(req.Aggregates) > 0 {
		return o.redriveGroups(ctx, req)
	}
	d, err := o.Depths(ctx, req.Consumer)
	if err != nil {
		return res, fmt.Errorf("redrive: %w", err)
	}
	if len(d) != 1 || d[0].DLQ < 0 {
		return res, fmt.Errorf("redrive: the DLQ depth of %s is unknown: %s", req.Consumer, d[0].Error)
	}
	// Only what the DLQ held at the start moves: a message dead-lettered
	// again meanwhile waits for the next redrive (no cycling), and the dry
	// run's count is the real run's.
	res.Waiting = d[0].DLQ
	limit := int(min(d[0].DLQ, int64(req.Max)))
	if req.DryRun {
		res.Moved, res.Complete = limit, true
		return res, nil
	}
	n, err := o.redrive(ctx, req.Consumer, limit, req.Progress)
	res.Moved = n
	return res, err
}

// redrive moves up to max messages from the consumer's DLQ back to its
// queue in DLQ order: it takes a batch with basic.get (unacknowledged),
// publishes it to the queue on one confirm channel (so the queue receives
// them in the same order), waits for the confirms, then acknowledges the
// batch in the DLQ. Each message loses the x-fifobox-error-* diagnostics and
// x-death history, gets its attempts header reset to 0 (a fresh retry
// budget) and x-fifobox-redriven incremented. If a publish fails, the batch
// is returned to the DLQ; if the acknowledgement is lost after the publish,
// the batch is moved again next time and the inbox drops the copies.
func (o *Operations) redrive(ctx context.Context, consumer string, max int, progress func(moved, total int64)) (int, error) {
	c, err := o.consumer(consumer)
	if err != nil {
		return 0, fmt.Errorf("redrive: %w", err)
	}
	if max < 1 {
		return 0, nil
	}
	conn, _, err := o.out.conn.get(ctx, o.cfg.ConnectWait)
	if err != nil {
		return 0, fmt.Errorf("redrive: %w", err)
	}
	get, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("redrive: open channel: %w", err)
	}
	defer get.Close()
	moved := 0
	for moved < max {
		if err := ctx.Err(); err != nil {
			return moved, fmt.Errorf("redrive: stopped after %d messages: %w", moved, err)
		}
		var batch []amqp091.Delivery
		for len(batch) < min(redriveBatch, max-moved) {
			m, ok, err := get.Get(c.DLQName(), false)
			if err != nil {
				return moved, fmt.Errorf("redrive: get from %s: %w", c.DLQName(), err)
			}
			if !ok {
				break
			}
			batch = append(batch, m)
		}
		if len(batch) == 0 {
			return moved, nil
		}
		out := make([]outgoing, len(batch))
		for i, m := range batch {
			out[i] = o.redriven(c, m)
		}
		last := batch[len(batch)-1].DeliveryTag
		if err := firstError(o.out.send(ctx, out)); err != nil {
			_ = get.Nack(last, true, true)
			return moved, fmt.Errorf("redrive: send to %s (the batch stays in the DLQ): %w", c.QueueName(), err)
		}
		if err := get.Ack(last, true); err != nil {
			return moved, fmt.Errorf("redrive: acknowledge in %s (the batch was re-sent; the inbox drops copies): %w", c.DLQName(), err)
		}
		moved += len(batch)
		if progress != nil {
			progress(int64(moved), int64(max))
		}
		o.cfg.Logger.Info("amqp redrive: moved a batch", "consumer", c.Name, "moved", moved)
	}
	return moved, nil
}

// redriven is m as redrive sends it back to c's queue: without the
// x-fifobox-error-* diagnostics and x-death history, its attempts header
// reset to 0 (a fresh retry budget) and x-fifobox-redriven incremented.
func (o *Operations) redriven(c Consumer, m amqp091.Delivery) outgoing {
	d := fromAMQP(m)
	h := copyHeaders(d.headers, true)
	for k := range h {
		// x-delivery-count: a quorum queue's count of this message's
		// deliveries from the DLQ (looks at it), not the consumer's.
		if strings.HasPrefix(k, "x-fifobox-error-") || k == HeaderConsumer || k == HeaderDeadAt || k == "x-delivery-count" {
			delete(h, k)
		}
	}
	h[o.cfg.Topology.AttemptsHeader] = int32(0)
	h[HeaderRedriven] = int32(headerInt(d.headers[HeaderRedriven]) + 1)
	return outgoing{exchange: "", key: c.QueueName(), msg: republish(d, m.Body, h)}
}

// Replay publishes msgs to the consumer's queue only (the default exchange
// routes by queue name), in the order given, with the topology's headers and
// a fresh retry budget. Messages go out in confirmed batches of up to 100
// with at most one message per aggregate in flight, so an aggregate's next
// event is published only after the previous one was confirmed; Replay stops
// at the first failure and returns how many messages were confirmed.
func (o *Operations) Replay(ctx context.Context, consumer string, msgs []outbox.Message) (int, error) {
	c, err := o.consumer(consumer)
	if err != nil {
		return 0, fmt.Errorf("replay: %w", err)
	}
	now := time.Now()
	sent := 0
	for start := 0; start < len(msgs); start += redriveBatch {
		chunk := msgs[start:min(start+redriveBatch, len(msgs))]
		idx := make([]int, len(chunk))
		for i := range chunk {
			if len(chunk[i].Body) > o.cfg.MaxMessageBytes {
				return sent, fmt.Errorf("replay: event %s: %w", chunk[i].EventID, ErrTooLarge)
			}
			idx[i] = i
		}
		for _, wave := range waves(chunk, idx) {
			out := make([]outgoing, len(wave))
			for k, i := range wave {
				out[k] = outgoing{exchange: "", key: c.QueueName(), msg: o.cfg.Topology.publishing(&chunk[i], now)}
			}
			var failed error
			for k, err := range o.out.send(ctx, out) {
				if err == nil {
					sent++
				} else if failed == nil {
					failed = fmt.Errorf("replay to %s: event %s: %w", c.QueueName(), chunk[wave[k]].EventID, err)
				}
			}
			if failed != nil {
				return sent, failed
			}
		}
	}
	return sent, nil
}

func firstError(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
