package amqp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/transport"
)

// A look at a DLQ takes its messages with basic.get, unacknowledged, and
// gives back those it keeps with one basic.nack (multiple, requeue): RabbitMQ
// returns them to their places, in order (a closed channel would requeue a
// quorum queue's messages out of order, so every path nacks first). Only
// the messages the DLQ held at the start are looked at: what is
// dead-lettered meanwhile waits for the next operation.

// dlqPass is one pass over a consumer's DLQ on a channel of its own.
type dlqPass struct {
	c     Consumer
	conn  *amqp091.Connection
	ch    *amqp091.Channel
	depth int
	taken []uint64 // delivery tags taken and not acknowledged, ascending
	acked int
}

func (o *Operations) openPass(ctx context.Context, consumer string, from transport.DLQ) (*dlqPass, error) {
	if from != "" && from != transport.ConsumerDLQ {
		return nil, fmt.Errorf("%s: %w", from, transport.ErrNoSuchDLQ)
	}
	c, err := o.consumer(consumer)
	if err != nil {
		return nil, err
	}
	conn, _, err := o.out.conn.get(ctx, o.cfg.ConnectWait)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ %s unreachable: %w", o.endpoint(), err)
	}
	q, err := inspect(conn, c.DLQName())
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	return &dlqPass{c: c, conn: conn, ch: ch, depth: q.Messages}, nil
}

// next takes the DLQ's next message, unacknowledged; ok is false once the
// messages held at the start are all taken.
func (p *dlqPass) next(taken int) (amqp091.Delivery, bool, error) {
	if taken >= p.depth {
		return amqp091.Delivery{}, false, nil
	}
	m, ok, err := p.ch.Get(p.c.DLQName(), false)
	if err != nil {
		return m, false, fmt.Errorf("get from %s: %w", p.c.DLQName(), err)
	}
	if ok {
		p.taken = append(p.taken, m.DeliveryTag)
	}
	return m, ok, nil
}

// ack deletes m, taken in this pass.
func (p *dlqPass) ack(m amqp091.Delivery) error {
	if err := p.ch.Ack(m.DeliveryTag, false); err != nil {
		return err
	}
	p.acked++
	p.taken = slices.DeleteFunc(p.taken, func(t uint64) bool { return t == m.DeliveryTag })
	return nil
}

// close gives back every message taken and not acknowledged, in place (one
// multiple nack up to the highest such tag; acknowledged ones are not
// outstanding any more), and waits a few seconds at most until the queue
// counts them again: a quorum queue applies returns asynchronously, and
// the next operation must find them there.
func (p *dlqPass) close() error {
	var err error
	if n := len(p.taken); n > 0 {
		if err = p.ch.Nack(p.taken[n-1], true, true); err != nil {
			err = fmt.Errorf("return messages to %s: %w", p.c.DLQName(), err)
		}
	}
	err = errors.Join(err, p.ch.Close())
	want := p.depth - p.acked
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if q, qerr := inspect(p.conn, p.c.DLQName()); qerr != nil || q.Messages >= want {
			break
		}
	}
	return err
}

// describe is m as an operator sees it.
func describe(m amqp091.Delivery, body bool) transport.DLQMessage {
	d := transport.DLQMessage{ID: m.MessageId}
	d.Describe(m.Body)
	d.ErrorClass, _ = m.Headers[HeaderErrorClass].(string)
	d.ErrorReason, _ = m.Headers[HeaderErrorReason].(string)
	if s, ok := m.Headers[HeaderDeadAt].(string); ok {
		if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
			d.DeadAt = &t
		}
	}
	if body {
		d.Body = string(m.Body)
	}
	return d
}

// Peek lists the DLQ's messages (transport.Operations.Peek) and returns
// every one to its place.
func (o *Operations) Peek(ctx context.Context, req transport.PeekRequest) (res transport.PeekResult, err error) {
	res.Total = -1
	if err := req.Validate(); err != nil {
		return res, err
	}
	if req.Limit < 1 {
		return res, errors.New("peek: limit must be at least 1")
	}
	p, err := o.openPass(ctx, req.Consumer, req.From)
	if err != nil {
		return res, fmt.Errorf("peek: %w", err)
	}
	defer func() { err = errors.Join(err, p.close()) }()
	res.Total = int64(p.depth)
	taken := 0
	for len(res.Messages) < req.Limit {
		m, ok, err := p.next(taken)
		if err != nil {
			return res, fmt.Errorf("peek: %w", err)
		}
		if !ok {
			res.Complete = true
			break
		}
		taken++
		if d := describe(m, req.Bodies); req.Matches(d) {
			res.Messages = append(res.Messages, d)
		}
	}
	res.Complete = res.Complete || taken >= p.depth
	return res, nil
}

// Discard acknowledges (deletes) the selected messages of the DLQ
// (transport.Operations.Discard) and returns every other one to its place.
func (o *Operations) Discard(ctx context.Context, req transport.DiscardRequest) (res transport.DiscardResult, err error) {
	if err := req.Validate(); err != nil {
		return res, err
	}
	if req.All() {
		return res, errors.New("discard: select messages by group or key")
	}
	if req.Max < 1 {
		return res, errors.New("discard: max must be at least 1")
	}
	p, err := o.openPass(ctx, req.Consumer, req.From)
	if err != nil {
		return res, fmt.Errorf("discard: %w", err)
	}
	defer func() { err = errors.Join(err, p.close()) }()
	found := map[string]bool{}
	for taken := 0; ; taken++ {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		m, ok, err := p.next(taken)
		if err != nil {
			return res, fmt.Errorf("discard: %w", err)
		}
		if !ok {
			break
		}
		if req.Progress != nil {
			req.Progress(int64(taken+1), int64(p.depth))
		}
		d := describe(m, false)
		if !req.Matches(d) || len(res.Discarded) >= req.Max {
			continue
		}
		if !req.DryRun {
			if err := p.ack(m); err != nil {
				return res, fmt.Errorf("discard: acknowledge in %s: %w", p.c.DLQName(), err)
			}
		}
		res.Discarded = append(res.Discarded, d)
		found[d.Key], found[d.ID] = true, true
	}
	for _, k := range req.Keys {
		if !found[k] {
			res.Missing = append(res.Missing, k)
		}
	}
	res.Complete = true
	return res, nil
}

// redriveGroups moves the messages of the selected groups (up to Max) from
// the DLQ back to the queue, in DLQ order, in confirmed batches, each
// acknowledged in the DLQ once the queue confirmed it; every other message
// stays where it was. A dry run counts them exactly.
func (o *Operations) redriveGroups(ctx context.Context, req transport.RedriveRequest) (res transport.RedriveResult, err error) {
	res.Waiting, res.InFlight = -1, -1
	p, err := o.openPass(ctx, req.Consumer, req.From)
	if err != nil {
		return res, fmt.Errorf("redrive: %w", err)
	}
	defer func() { err = errors.Join(err, p.close()) }()
	res.Waiting = int64(p.depth)
	sel := transport.DLQSelection{Groups: req.Groups, Aggregates: req.Aggregates}
	var batch []amqp091.Delivery
	flush := func() error {
		if len(batch) == 0 || req.DryRun {
			res.Moved += len(batch)
			batch = batch[:0]
			return nil
		}
		out := make([]outgoing, len(batch))
		for i, m := range batch {
			out[i] = o.redriven(p.c, m)
		}
		if err := firstError(o.out.send(ctx, out)); err != nil {
			return fmt.Errorf("send to %s (the messages stay in the DLQ): %w", p.c.QueueName(), err)
		}
		for _, m := range batch {
			if err := p.ack(m); err != nil {
				return fmt.Errorf("acknowledge in %s (re-sent; the inbox drops copies): %w", p.c.DLQName(), err)
			}
		}
		res.Moved += len(batch)
		batch = batch[:0]
		if req.Progress != nil {
			req.Progress(int64(res.Moved), -1)
		}
		return nil
	}
	for taken := 0; res.Moved+len(batch) < req.Max; taken++ {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("redrive: stopped after %d messages: %w", res.Moved, err)
		}
		m, ok, err := p.next(taken)
		if err != nil {
			return res, fmt.Errorf("redrive: %w", err)
		}
		if !ok {
			break
		}
		if !sel.Matches(describe(m, false)) {
			continue
		}
		batch = append(batch, m)
		if len(batch) == redriveBatch {
			if err := flush(); err != nil {
				return res, fmt.Errorf("redrive: %w", err)
			}
		}
	}
	if err := flush(); err != nil {
		return res, fmt.Errorf("redrive: %w", err)
	}
	res.Complete = true
	return res, nil
}
