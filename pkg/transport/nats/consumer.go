package nats

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Runner consumes one consumer's durable pull consumer on this machine or in
// a container, on the consumer engine every transport shares
// (inbox.Engine).
//
// Order: JetStream delivers a consumer's messages in stream order, and the
// dispatcher stored each aggregate's events in order. The engine applies
// different aggregates in parallel (Consumer.Workers lanes, a lane's
// waiting messages in one inbox transaction) and one aggregate's events one
// after the other. A transiently failing event is nacked with the retry
// policy's delay and its aggregate parked in the database (inbox_parked):
// the aggregate's later messages wait in memory behind it, and after a
// restart the park still holds them back. Every message the engine holds,
// queued, running, waiting behind a retrying event or waiting out a
// database outage, is kept in progress (InProgress every AckWait/4), so the
// server redelivers nothing the runner still has: deliveries count only
// real redeliveries, and failures are counted per event by the engine.
// Run one Runner per consumer: a pull consumer shares its messages among
// all clients pulling from it, and two runners could then apply one
// aggregate's events at the same time (a second runner is a cold standby,
// not extra throughput; raise Workers instead).
//
// Each message is acknowledged only after the inbox transaction committed,
// or terminated after its copy reached the dead-letter stream (PubAck). The
// client reconnects on its own after a dropped connection; the runner opens
// a new connection if its connection is closed, or its consumer vanished.
type Runner struct {
	cfg    Config
	engine *inbox.Engine
	c      Consumer
	dlq    *sender
	onSkip func(inbox.Settlement)
	// lastDelivery is the consumer sequence of the session's last delivery
	// and lost says one was skipped (both used on the client's delivery
	// goroutine only, reset per session): see dispatch.
	lastDelivery uint64
	lost         bool
	onLost       func()
}

// errDeliveryLost ends a session whose consumer sequence skipped a number:
// a delivery sent while the connection was cut never arrived.
var errDeliveryLost = errors.New("a delivery was lost in transit (consumer sequence gap)")

var _ transport.Runner = (*Runner)(nil)

// NewRunner returns a Runner for cc.Consumer, applying events with apply
// through the inbox in db.
func NewRunner(cfg Config, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (*Runner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new nats runner: %w", err)
	}
	r := &Runner{cfg: cfg, onSkip: cc.OnSettle}
	e, c, err := newEngine(&r.cfg, db, apply, cc)
	if err != nil {
		return nil, fmt.Errorf("new nats runner: %w", err)
	}
	r.engine, r.c = e, c
	r.dlq = newSender(&r.cfg, "consumer/"+c.Name+"/dlq")
	return r, nil
}

// Run consumes until ctx is done, reconnecting after outages, and returns
// nil then. Messages in hand when ctx ends are finished (within
// HandlerTimeout) and settled, not abandoned. Call it once.
func (r *Runner) Run(ctx context.Context) error {
	defer r.dlq.close()
	failures := 0
	waited := false // the last wait let every earlier delivery come due
	for ctx.Err() == nil {
		started := time.Now()
		err := r.session(ctx, waited)
		waited = false
		if ctx.Err() != nil {
			return nil
		}
		if time.Since(started) > time.Minute {
			failures = 0
		}
		failures++
		wait := min(r.cfg.ReconnectWait<<min(failures-1, 16), r.cfg.ReconnectMaxDelay)
		if errors.Is(err, errDeliveryLost) {
			// The lost delivery comes back only when its AckWait ends; the
			// ones after it were left unacknowledged, so they expire with it
			// and the server redelivers them together, in stream order.
			// Resuming sooner would apply the later ones first. The session's
			// pull request may take deliveries for up to one pull heartbeat
			// after it ended (see pullHeartbeat): wait for those too. This
			// wait covers everything the session start would wait for again.
			ackWait := time.Duration(r.c.AckWait)
			wait, waited = ackWait+pullHeartbeat(ackWait)+time.Second, true
		}
		if err != nil {
			r.cfg.Logger.Warn("nats consumer: session ended; reconnecting", "consumer", r.c.Name, "retry_in", wait.String(), "error", err.Error())
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
// disappears, a message cannot be settled, or ctx ends. due says Run has
// just waited until every earlier delivery was due again (after a lost
// delivery), so the session starts pulling at once.
func (r *Runner) session(ctx context.Context, due bool) error {
	c := r.c
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
	// Deliveries an earlier reader left unacknowledged (a process that
	// crashed, a connection that was cut) come back only when their AckWait
	// ends, while a new pull gets the messages after them at once: an
	// aggregate's event 2 could be applied before its event 1 (conformance
	// EventKillingTheConsumerIsDeadLettered). Start pulling once they are
	// due again; the server redelivers before it delivers anything new.
	// After a lost delivery Run has waited for that already.
	if info, err := cons.Info(ctx); !due && err == nil && info.NumAckPending > 0 {
		wait := time.Duration(c.AckWait) + time.Second
		r.cfg.Logger.Info("nats consumer: waiting for an earlier reader's unacknowledged deliveries to come back", "consumer", c.Name, "pending", info.NumAckPending, "wait", wait.String())
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
	fatal := make(chan error, 2)
	report := func(err error) {
		select {
		case fatal <- err:
		default:
		}
	}
	r.lastDelivery, r.lost = 0, false
	r.onLost = func() { report(errDeliveryLost) }
	s := r.engine.Start(ctx, &broker{topo: &r.cfg.Topology, c: c, dlq: r.dlq, log: r.cfg.Logger}, report)
	cc, err := cons.Consume(func(m jetstream.Msg) { r.dispatch(s, m) },
		jetstream.PullMaxMessages(c.Batch),
		jetstream.PullHeartbeat(pullHeartbeat(time.Duration(c.AckWait))),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) {
				report(err)
				return
			}
			r.cfg.Logger.Debug("nats consumer: pull error (the client retries)", "consumer", c.Name, "error", err.Error())
		}))
	if err != nil {
		s.Stop(false)
		return fmt.Errorf("consume %s: %w", c.Durable(), err)
	}

	var end error
	select {
	case <-ctx.Done():
	case <-closed:
		end = errors.New("connection closed")
	case err := <-fatal:
		end = fmt.Errorf("consumer %s: %w", c.Durable(), err)
	}
	// Stop pulling, let the engine finish what it holds (each batch within
	// HandlerTimeout) when stopping cleanly, then hand back what is left so
	// it comes again without waiting for AckWait; the parks keep it behind
	// its heads.
	cc.Stop()
	select {
	case <-cc.Closed():
	case <-time.After(5 * time.Second):
	}
	if errors.Is(end, errDeliveryLost) {
		// Everything the engine holds came before the lost delivery:
		// finish it. Nothing is handed back: a Nak would bring it back
		// before the lost one.
		s.Stop(true)
		return end
	}
	for _, rec := range s.Stop(end == nil) {
		_ = rec.Handle.(*delivery).m.Nak()
	}
	if end == nil {
		// Flush acknowledgements before the connection closes.
		_ = nc.FlushTimeout(2 * time.Second)
	}
	return end
}

// pullHeartbeat is the idle heartbeat of the session's pull requests: 5s,
// or a quarter of ackWait when that is shorter (at least the client's
// 500ms). A session ended on a lost delivery leaves its pull request on the
// server, which notices it has no reader only at the request's next
// heartbeat. Until then a redelivery due goes to that request and is lost
// again (nats-server 2.9) or queued behind the later ones (2.10 and later):
// either way the lost delivery would come back after those that followed
// it. The heartbeat makes the server drop the request before the lost
// delivery's ack wait ends.
func pullHeartbeat(ackWait time.Duration) time.Duration {
	return max(min(5*time.Second, ackWait/4), 500*time.Millisecond)
}

// dispatch runs on the client's delivery goroutine, in delivery order: it
// skips what the consumer's filters do not select and submits the rest to
// the engine.
func (r *Runner) dispatch(s *inbox.Session, m jetstream.Msg) {
	md, err := m.Metadata()
	if err != nil {
		r.cfg.Logger.Warn("nats consumer: not a JetStream message; ignored", "consumer", r.c.Name, "error", err.Error())
		return
	}
	// Every delivery, redeliveries included, takes the next consumer
	// sequence. A skipped number is a delivery sent while the connection was
	// cut: it comes back only after its AckWait, so applying what follows
	// now could apply an aggregate's later event before it. Stop taking
	// deliveries (left unacknowledged) and end the session (see Run).
	if r.lost || (r.lastDelivery != 0 && md.Sequence.Consumer != r.lastDelivery+1) {
		if !r.lost {
			r.lost = true
			r.cfg.Logger.Warn("nats consumer: a delivery was lost in transit; resuming after its ack wait",
				"consumer", r.c.Name, "after", r.lastDelivery, "got", md.Sequence.Consumer)
			r.onLost()
		}
		return
	}
	r.lastDelivery = md.Sequence.Consumer
	if !r.cfg.Topology.Selects(r.c, m.Subject()) {
		_ = m.Ack()
		if r.onSkip != nil {
			r.onSkip(inbox.Settlement{Consumer: r.c.Name, Action: inbox.ActionSkipped, RecordID: strconv.FormatUint(md.Sequence.Stream, 10),
				Deliveries: int(md.NumDelivered)})
		}
		return
	}
	s.Submit(r.c.record(m, md))
}
