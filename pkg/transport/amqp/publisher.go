package amqp

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Publish outcomes. Every one but ErrTooLarge and ErrRoutingKey is retryable:
// retrying is always safe (the message id is the event id, and consumers
// drop duplicates through the inbox), while marking an event dead parks its
// aggregate until an operator acts.
var (
	// ErrUnroutable: the broker confirmed the message but no queue is bound
	// for its routing key (basic.return, NO_ROUTE; published with mandatory)
	// although the topology says a consumer selects it. Retryable: the
	// cause is a queue deleted or not yet provisioned (or, under the
	// alternate policy, the catch-all queue), which provisioning repairs.
	// An event that no consumer of the topology selects is not an error:
	// the topology's Unrouted policy decides (delivered and reported by
	// default), so it never holds its aggregate back.
	ErrUnroutable = errors.New("amqp: unroutable: no queue is bound for the routing key")
	// ErrNacked: the broker refused the message (basic.nack): a queue it
	// routes to is full (x-max-length with reject-publish) or could not store
	// it. Retryable: the queue drains. When one of several queues refused it,
	// the others have a copy, and the retry gives them a duplicate that their
	// inbox drops.
	ErrNacked = errors.New("amqp: nacked: the broker refused the message (a queue is full or failed to store it)")
	// ErrConfirmLost: the channel or connection closed before the broker
	// confirmed. Retryable: the message may or may not have been stored.
	ErrConfirmLost = errors.New("amqp: no confirm: the channel closed before the broker confirmed the message")
	// ErrTooLarge (permanent): the body exceeds Config.MaxMessageBytes.
	ErrTooLarge = errors.New("amqp: message too large")
	// ErrRoutingKey (permanent): the rendered routing key exceeds 255 bytes.
	ErrRoutingKey = errors.New("amqp: routing key longer than 255 bytes")
	// ErrPredecessorFailed (retryable): an earlier message of the same
	// aggregate in the same Publish call was not published, so this one was
	// not sent (it would overtake it).
	ErrPredecessorFailed = errors.New("amqp: an earlier message of the same aggregate was not published")
)

// Publisher is the outbox.Publisher for a RabbitMQ exchange: persistent
// messages, publisher confirms, mandatory routing, message id = event id,
// routing key and headers from the topology's templates.
//
// Each Publish call takes a confirm-mode channel of its own (channels are
// pooled), publishes every message without waiting, then waits for the
// confirms of all of them: one round trip per call, not per message. The
// dispatcher runs PublishConcurrency calls at once, so that many channels
// stay open. After a dropped connection the next call reconnects (waiting up
// to Config.ConnectWait); messages whose confirm was lost are reported
// retryable.
type Publisher struct {
	cfg  Config
	topo *Topology
	s    *sender

	unrouted atomic.Int64
}

// PublishStats counts what a Publisher did beyond plain deliveries.
type PublishStats struct {
	// Unrouted counts events that no consumer of the topology selects,
	// handled by the topology's Unrouted policy (each also logged as
	// transport.UnroutedLogMessage).
	Unrouted int64
}

// Stats returns the publisher's counts since it was created.
func (p *Publisher) Stats() PublishStats { return PublishStats{Unrouted: p.unrouted.Load()} }

var _ outbox.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher. It does not connect until the first Publish.
func NewPublisher(cfg Config) (*Publisher, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp publisher: %w", err)
	}
	p := &Publisher{cfg: cfg}
	p.topo = &p.cfg.Topology
	p.s = newSender(&p.cfg, "publisher")
	return p, nil
}

// Close closes the publisher's connection.
func (p *Publisher) Close() error { return p.s.close() }

// Publish implements outbox.Publisher.
func (p *Publisher) Publish(ctx context.Context, msgs []outbox.Message) []error {
	errs := make([]error, len(msgs))
	out := make([]outgoing, len(msgs))
	var ready []int
	now := time.Now()
	for i := range msgs {
		var err error
		if out[i], err = p.message(&msgs[i], now); err != nil {
			errs[i] = err
			continue
		}
		ready = append(ready, i)
	}
	if len(ready) == 0 {
		return errs
	}
	pc, err := p.s.channel(ctx)
	if err != nil {
		for _, i := range ready {
			errs[i] = fmt.Errorf("amqp publish: %w", err)
		}
		return errs
	}
	defer p.s.release(pc)
	// Waves: the k-th message of each aggregate goes in wave k, after wave
	// k-1 is confirmed. The dispatcher never passes two messages of one
	// aggregate; the publisher does not rely on it.
	type aggKey struct{ typ, id string }
	failed := map[aggKey]bool{}
	for _, wave := range waves(msgs, ready) {
		var send []int
		for _, i := range wave {
			if failed[aggKey{msgs[i].AggregateType, msgs[i].GroupID}] {
				errs[i] = ErrPredecessorFailed
				continue
			}
			send = append(send, i)
		}
		wout := make([]outgoing, len(send))
		werrs := make([]error, len(send))
		for k, i := range send {
			wout[k] = out[i]
		}
		pc.sendOn(ctx, wout, werrs)
		for k, i := range send {
			werrs[k] = p.unroutedPolicy(&msgs[i], werrs[k])
			if errs[i] = werrs[k]; errs[i] != nil {
				failed[aggKey{msgs[i].AggregateType, msgs[i].GroupID}] = true
			}
		}
	}
	return errs
}

// unroutedPolicy applies the topology's Unrouted policy to m's publish
// result err: an event no consumer selects is reported, and, returned by the
// broker under the deliver policy, counts as delivered. Any other result
// stands (a return for an event the topology routes means a missing queue:
// retryable).
func (p *Publisher) unroutedPolicy(m *outbox.Message, err error) error {
	pol := p.topo.Unrouted.Policy
	if (err == nil && pol != transport.UnroutedAlternate) || (err != nil && !errors.Is(err, ErrUnroutable)) {
		return err // the common case costs no topology check
	}
	if p.selects(m) {
		return err
	}
	switch {
	case pol == transport.UnroutedAlternate && err == nil:
		p.unrouted.Add(1)
		transport.LogUnrouted(p.cfg.Logger, transport.RabbitMQ, pol, m, "queue "+p.topo.Unrouted.Queue+" (alternate exchange "+p.topo.AlternateExchange()+")")
	case pol == transport.UnroutedDeliver && err != nil:
		p.unrouted.Add(1)
		transport.LogUnrouted(p.cfg.Logger, transport.RabbitMQ, pol, m, "nowhere (no queue is bound for it)")
		return nil
	}
	return err
}

// message renders one outbox message as a publishing to the events exchange.
func (p *Publisher) message(m *outbox.Message, now time.Time) (outgoing, error) {
	if p.cfg.Wire != nil {
		return p.wireMessage(m)
	}
	if len(m.Body) > p.cfg.MaxMessageBytes {
		return outgoing{}, envelope.Permanent(fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, len(m.Body), p.cfg.MaxMessageBytes))
	}
	key := p.topo.routingKey.Render(m, nil)
	if len(key) > 255 {
		return outgoing{}, envelope.Permanent(fmt.Errorf("%w: %d bytes", ErrRoutingKey, len(key)))
	}
	return outgoing{exchange: p.topo.Exchange.Name, key: key, msg: p.topo.publishing(m, now)}, nil
}

// publishing is m as an AMQP message with the topology's headers.
func (t *Topology) publishing(m *outbox.Message, now time.Time) amqp091.Publishing {
	return amqp091.Publishing{
		Headers:      t.headersFor(m),
		ContentType:  "application/json",
		DeliveryMode: amqp091.Persistent,
		MessageId:    m.EventID,
		Type:         m.EventType,
		Timestamp:    now,
		AppId:        "fifobox",
		Body:         m.Body,
	}
}

// headersFor renders the header templates for m and sets the attempts header to 0.
func (t *Topology) headersFor(m *outbox.Message) amqp091.Table {
	h := make(amqp091.Table, len(t.headers)+1)
	for name, tpl := range t.headers {
		if v := tpl.Render(m, nil); v != "" {
			h[name] = v
		}
	}
	h[t.AttemptsHeader] = int32(0)
	return h
}

// waves splits ready into waves so that no wave holds two messages of one aggregate.
func waves(msgs []outbox.Message, ready []int) [][]int {
	type key struct{ typ, id string }
	seen := map[key]int{}
	var out [][]int
	for _, i := range ready {
		k := key{msgs[i].AggregateType, msgs[i].GroupID}
		n := seen[k]
		seen[k] = n + 1
		if n == len(out) {
			out = append(out, nil)
		}
		out[n] = append(out[n], i)
	}
	return out
}

// outgoing is one message to publish with a confirm.
type outgoing struct {
	exchange, key string
	msg           amqp091.Publishing
}

// sender publishes with confirms over pooled confirm-mode channels of one
// connection, reconnecting after it drops. The Publisher, the consumers'
// retry and dead-letter sends, redrive and replay all use one.
type sender struct {
	cfg  *Config
	conn *connector
	idle chan *pubChannel
}

type pubChannel struct {
	ch      *amqp091.Channel
	gen     uint64
	returns chan amqp091.Return
	closes  chan *amqp091.Error
}

func newSender(cfg *Config, role string) *sender {
	return &sender{cfg: cfg, conn: newConnector(cfg, role), idle: make(chan *pubChannel, 256)}
}

func (s *sender) close() error {
	for {
		select {
		case pc := <-s.idle:
			_ = pc.ch.Close()
		default:
			return s.conn.close()
		}
	}
}

// send publishes out on one channel and waits for every confirm; errs[i] is
// out[i]'s result (nil: confirmed and routed).
func (s *sender) send(ctx context.Context, out []outgoing) []error {
	errs := make([]error, len(out))
	pc, err := s.channel(ctx)
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	pc.sendOn(ctx, out, errs)
	s.release(pc)
	return errs
}

// sendOne is send for one message.
func (s *sender) sendOne(ctx context.Context, o outgoing) error { return s.send(ctx, []outgoing{o})[0] }

// sendOn publishes out without waiting, then waits for every confirm and
// maps it, and any basic.return, to a result in errs.
func (pc *pubChannel) sendOn(ctx context.Context, out []outgoing, errs []error) {
	dcs := make([]*amqp091.DeferredConfirmation, len(out))
	for i, o := range out {
		if pc.ch.IsClosed() {
			errs[i] = pc.closeReason(ErrConfirmLost)
			continue
		}
		dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, o.exchange, o.key, true, false, o.msg)
		if err != nil {
			errs[i] = pc.closeReason(fmt.Errorf("%w: %v", ErrConfirmLost, err))
			continue
		}
		dcs[i] = dc
	}
	for i, dc := range dcs {
		if dc == nil {
			continue
		}
		acked, err := dc.WaitContext(ctx)
		switch {
		case err != nil:
			// Timed out: the confirm may still come, on a channel we now
			// abandon so that it is never read as another call's.
			errs[i] = fmt.Errorf("%w: waiting for the confirm: %v", ErrConfirmLost, err)
			_ = pc.ch.Close()
		case !acked && pc.ch.IsClosed():
			errs[i] = pc.closeReason(ErrConfirmLost)
		case !acked:
			errs[i] = fmt.Errorf("publish to exchange %q key %q: %w", out[i].exchange, out[i].key, ErrNacked)
		}
	}
	// A basic.return reaches us before the confirm of the same message, so
	// every return for these messages is buffered by now.
	for {
		select {
		case r, ok := <-pc.returns:
			if !ok {
				return
			}
			for i, o := range out {
				if o.msg.MessageId == r.MessageId && o.key == r.RoutingKey && errs[i] == nil {
					errs[i] = fmt.Errorf("publish to exchange %q key %q: %w (%d %s)", r.Exchange, r.RoutingKey, ErrUnroutable, r.ReplyCode, r.ReplyText)
				}
			}
		default:
			return
		}
	}
}

// closeReason names why the channel closed (e.g. 404 NOT_FOUND: no
// exchange), or returns fallback.
func (pc *pubChannel) closeReason(fallback error) error {
	select {
	case e, ok := <-pc.closes:
		if ok && e != nil {
			// Keep it for the other messages of this call.
			err := fmt.Errorf("%w: the broker closed the channel: %d %s", ErrConfirmLost, e.Code, e.Reason)
			pc.closes = closedWith(e)
			return err
		}
	default:
	}
	return fallback
}

func closedWith(e *amqp091.Error) chan *amqp091.Error {
	c := make(chan *amqp091.Error, 1)
	c <- e
	close(c)
	return c
}

// channel returns a confirm-mode channel on the current connection.
func (s *sender) channel(ctx context.Context) (*pubChannel, error) {
	conn, gen, err := s.conn.get(ctx, s.cfg.ConnectWait)
	if err != nil {
		return nil, err
	}
	for {
		select {
		case pc := <-s.idle:
			if pc.gen == gen && !pc.ch.IsClosed() {
				return pc, nil
			}
			_ = pc.ch.Close()
			continue
		default:
		}
		break
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("%w: open channel: %v", ErrUnavailable, err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("%w: confirm mode: %v", ErrUnavailable, err)
	}
	return &pubChannel{ch: ch, gen: gen,
		returns: ch.NotifyReturn(make(chan amqp091.Return, 256)),
		closes:  ch.NotifyClose(make(chan *amqp091.Error, 1)),
	}, nil
}

// release pools a healthy channel, or closes it.
func (s *sender) release(pc *pubChannel) {
	if pc.ch.IsClosed() {
		return
	}
	select {
	case s.idle <- pc:
	default:
		_ = pc.ch.Close()
	}
}
