package nats

import (
	"context"
	"errors"
	"fmt"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Runner consumes one consumer's durable pull consumer on this machine or in
// a container, applying each message through the inbox.
//
// Order: JetStream delivers a consumer's messages in stream order, and the
// dispatcher stored each aggregate's events in order. The runner hashes each
// message's aggregate to one of Consumer.Workers lanes (transport.Lanes), so
// different aggregates apply in parallel and one aggregate's events one
// after the other; an aggregate whose head is waiting for a retry holds its
// later messages in memory until the head settles (see settler). Run one
// Runner per consumer: a pull consumer shares its messages among all
// clients pulling from it, and two runners could then apply one aggregate's
// events at the same time (a second runner is a cold standby, not extra
// throughput; raise Workers instead).
//
// Each message is acknowledged only after the inbox transaction committed,
// or terminated after its copy reached the dead-letter stream (PubAck). The
// client reconnects on its own after a dropped connection; the runner opens
// a new connection if its connection is closed, or its consumer vanished.
type Runner struct {
	cfg Config
	s   *settler
	dlq *sender
}

var _ transport.Runner = (*Runner)(nil)

// NewRunner returns a Runner for cc.Consumer, applying events with apply
// through the inbox in db.
func NewRunner(cfg Config, db inbox.DB, apply inbox.Apply, cc ConsumerConfig) (*Runner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new nats runner: %w", err)
	}
	r := &Runner{cfg: cfg}
	r.dlq = newSender(&r.cfg, "consumer/"+cc.Consumer+"/dlq")
	s, err := newSettler(&r.cfg, db, apply, cc, r.dlq)
	if err != nil {
		return nil, fmt.Errorf("new nats runner: %w", err)
	}
	r.s = s
	return r, nil
}

// Run consumes until ctx is done, reconnecting after outages, and returns
// nil then. Messages in hand when ctx ends are finished (within
// HandlerTimeout) and settled, not abandoned. Call it once.
func (r *Runner) Run(ctx context.Context) error {
	defer r.dlq.close()
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
		wait := min(r.cfg.ReconnectWait<<min(failures-1, 16), r.cfg.ReconnectMaxDelay)
		if err != nil {
			r.cfg.Logger.Warn("nats consumer: session ended; reconnecting", "consumer", r.s.c.Name, "retry_in", wait.String(), "error", err.Error())
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

// session consumes on one connection until it is closed, the consumer
// disappears, or ctx ends.
func (r *Runner) session(ctx context.Context) error {
	c := r.s.c
	nc, err := r.cfg.dial("consumer/" + c.Name)
	if err != nil {
		return err
	}
	defer nc.Close()
	closed := nc.StatusChanged(natsgo.CLOSED)
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	cons, err := js.Consumer(ctx, r.cfg.Topology.Stream, c.Durable())
	if err != nil {
		return fmt.Errorf("consumer %s on stream %s (provisioned?): %w", c.Durable(), r.cfg.Topology.Stream, err)
	}

	lanes := transport.NewLanes(c.Workers, c.Batch)
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	fatal := make(chan error, 1)
	cc, err := cons.Consume(func(m jetstream.Msg) { r.dispatch(sctx, lanes, m) },
		jetstream.PullMaxMessages(c.Batch),
		jetstream.PullHeartbeat(5*time.Second),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) {
				select {
				case fatal <- err:
				default:
				}
				return
			}
			r.cfg.Logger.Debug("nats consumer: pull error (the client retries)", "consumer", c.Name, "error", err.Error())
		}))
	if err != nil {
		lanes.Close()
		return fmt.Errorf("consume %s: %w", c.Durable(), err)
	}
	// Held messages must be kept in progress well inside AckWait.
	tick := time.NewTicker(max(time.Duration(c.AckWait)/4, 250*time.Millisecond))
	defer tick.Stop()

	var end error
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case <-closed:
			end = errors.New("connection closed")
			break loop
		case err := <-fatal:
			end = fmt.Errorf("consumer %s: %w", c.Durable(), err)
			break loop
		case <-tick.C:
			for _, key := range r.s.tend() {
				_ = lanes.Submit(sctx, key, func(int) { r.s.releaseOverdue(sctx, key) })
			}
		}
	}
	// Stop pulling, let the lanes finish what they hold (each message
	// settles within HandlerTimeout), then send held messages back to come
	// after their heads.
	cc.Stop()
	stop()
	select {
	case <-cc.Closed():
	case <-time.After(5 * time.Second):
	}
	lanes.Close()
	r.s.abandon()
	if end == nil {
		// Flush acknowledgements before the connection closes.
		_ = nc.FlushTimeout(2 * time.Second)
	}
	return end
}

// dispatch runs on the client's delivery goroutine, in delivery order: it
// skips what the consumer's filters do not select, decodes the rest and
// queues each on its aggregate's lane (waiting while the lane is full).
func (r *Runner) dispatch(ctx context.Context, lanes *transport.Lanes, m jetstream.Msg) {
	md, err := m.Metadata()
	if err != nil {
		r.cfg.Logger.Warn("nats consumer: not a JetStream message; ignored", "consumer", r.s.c.Name, "error", err.Error())
		return
	}
	if !r.cfg.Topology.Selects(r.s.c, m.Subject()) {
		_ = m.Ack()
		r.s.settled(Settlement{Consumer: r.s.c.Name, Action: ActionSkipped, Subject: m.Subject(), StreamSeq: md.Sequence.Stream, Deliveries: int(md.NumDelivered)})
		return
	}
	d := &delivery{m: m, md: md}
	d.env, d.decodeErr = envelope.Decode(m.Data())
	key := d.key()
	// If ctx ended, the message is not settled and comes back after AckWait.
	_ = lanes.Submit(ctx, key, func(int) { r.s.handle(ctx, d) })
}
