package nats

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
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
	// mu guards the dispatch state below (the client's delivery goroutine
	// and the hold timer), reset per session. lastDelivery is the consumer
	// sequence of the session's last delivery and lost says one was
	// skipped; toHold counts the redeliveries the session still expects
	// first and held keeps them (see dispatch).
	mu           sync.Mutex
	lastDelivery uint64
	lost         bool
	onLost       func()
	toHold       int
	held         []*inbox.Record
	holdTimer    *time.Timer
	holdUntil    time.Time
	holdFor      *inbox.Session
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
		// After a lost delivery the next session waits for it to come due
		// again (see awaitEarlierReaders) before it pulls.
		wait := min(r.cfg.ReconnectWait<<min(failures-1, 16), r.cfg.ReconnectMaxDelay)
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
// disappears, a message cannot be settled, a delivery is lost, or ctx ends.
func (r *Runner) session(ctx context.Context) error {
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
	pending, delivered, err := r.awaitEarlierReaders(ctx, cons)
	if err != nil || ctx.Err() != nil {
		return err
	}
	fatal := make(chan error, 2)
	report := func(err error) {
		select {
		case fatal <- err:
		default:
		}
	}
	s := r.engine.Start(ctx, &broker{topo: &r.cfg.Topology, c: c, dlq: r.dlq, log: r.cfg.Logger}, report)
	r.mu.Lock()
	r.lastDelivery, r.lost = delivered, false
	r.onLost = func() { report(errDeliveryLost) }
	r.toHold, r.held, r.holdFor = pending, nil, s
	r.holdTimer = time.AfterFunc(time.Hour, r.releaseHeldOnQuiet)
	r.holdTimer.Stop()
	r.mu.Unlock()
	defer func() {
		// Held redeliveries the session did not submit come back after
		// their AckWait, to the next session.
		r.mu.Lock()
		r.holdTimer.Stop()
		r.toHold, r.held, r.holdFor = 0, nil, nil
		r.mu.Unlock()
	}()
	cc, err := cons.Consume(func(m jetstream.Msg) { r.dispatch(s, m) },
		jetstream.PullMaxMessages(c.Batch),
		jetstream.PullHeartbeat(pullHeartbeat(time.Duration(c.AckWait))),
		jetstream.PullExpiry(pullExpiry(time.Duration(c.AckWait))),
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

// awaitEarlierReaders returns when the session may start pulling without
// an aggregate's later event overtaking an earlier one (or ctx ends).
//
// Deliveries an earlier reader left unacknowledged (a process that crashed,
// a connection that was cut, a delivery lost in transit) come back only
// when their AckWait ends, while a new pull gets the messages after them at
// once: an aggregate's event 2 could be applied before its event 1
// (conformance EventKillingTheConsumerIsDeadLettered). And a pull request
// an earlier reader left on the server takes deliveries, redeliveries
// included, that then never arrive anywhere: the ended session's request
// until the server sees, at its next heartbeat, that nobody reads it; a
// partitioned connection's requests (the server still thinks the
// connection alive, and it shares the reply subject) until they expire
// (pullExpiry). So: wait until the consumer has no waiting pull request
// (the session has made none yet, so they are all someone else's), then,
// if anything is unacknowledged, until AckWait + 1s have passed with none;
// the server redelivers those before it delivers anything new, in the
// order they came due (dispatch puts them back in stream order). It
// returns how many are unacknowledged and the consumer sequence of the
// last delivery: the session's first delivery must be the next one, or one
// went to a pull request on a connection partitioned since (dispatch).
func (r *Runner) awaitEarlierReaders(ctx context.Context, cons jetstream.Consumer) (pending int, delivered uint64, err error) {
	ackWait := time.Duration(r.c.AckWait)
	poll := pullHeartbeat(ackWait)
	var clear time.Time // since when no one else's pull request was seen
	logged := false
	for {
		info, err := cons.Info(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return 0, 0, nil
			}
			return 0, 0, fmt.Errorf("consumer %s info: %w", r.c.Durable(), err)
		}
		switch {
		case info.NumWaiting > 0:
			clear = time.Time{}
			if !logged {
				logged = true
				r.cfg.Logger.Info("nats consumer: waiting for an earlier reader's pull requests to end", "consumer", r.c.Name,
					"waiting", info.NumWaiting, "pending", info.NumAckPending)
			}
		case info.NumAckPending == 0 || !clear.IsZero() && time.Since(clear) >= ackWait+time.Second:
			return info.NumAckPending, info.Delivered.Consumer, nil
		case clear.IsZero():
			clear = time.Now()
			r.cfg.Logger.Info("nats consumer: waiting for an earlier reader's unacknowledged deliveries to come back", "consumer", r.c.Name,
				"pending", info.NumAckPending, "wait", (ackWait + time.Second).String())
		}
		t := time.NewTimer(poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, 0, nil
		case <-t.C:
		}
	}
}

// pullHeartbeat is the idle heartbeat of the session's pull requests: 5s,
// or a quarter of ackWait when that is shorter (at least the client's
// 500ms). A session's pull request outlives the session until the server
// notices, at the request's next heartbeat, that nobody reads it; until
// then a redelivery goes to it and is lost again (nats-server 2.9) or is
// queued behind the later ones (2.10 and later). The next session waits
// for it (awaitEarlierReaders); a short heartbeat keeps that wait short.
func pullHeartbeat(ackWait time.Duration) time.Duration {
	return max(min(5*time.Second, ackWait/4), 500*time.Millisecond)
}

// pullExpiry is how long one pull request of the session lasts: ackWait,
// at most 30s (the client's default), at least two heartbeats (the
// client's rule). A request on a connection the network lost without a
// FIN or RST stays on the server, taking deliveries nobody receives, until
// it expires or the server's own ping check drops the connection
// (minutes): the expiry bounds how long the next session waits for it.
func pullExpiry(ackWait time.Duration) time.Duration {
	return max(min(30*time.Second, ackWait), 2*pullHeartbeat(ackWait))
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
	r.mu.Lock()
	defer r.mu.Unlock()
	// Every delivery, redeliveries included, takes the next consumer
	// sequence, counting on from the consumer's last delivery before the
	// session. A skipped number is a delivery sent while the connection was
	// cut: it comes back only after its AckWait, so applying what follows
	// now could apply an aggregate's later event before it. Stop taking
	// deliveries (left unacknowledged) and end the session (see Run).
	if r.lost || md.Sequence.Consumer != r.lastDelivery+1 {
		if !r.lost {
			r.lost = true
			r.cfg.Logger.Warn("nats consumer: a delivery was lost in transit; resuming after its ack wait",
				"consumer", r.c.Name, "after", r.lastDelivery, "got", md.Sequence.Consumer)
			// What is held may come after the lost one: it comes back
			// with it.
			r.toHold, r.held = 0, nil
			r.onLost()
		}
		return
	}
	r.lastDelivery = md.Sequence.Consumer
	// The session's first deliveries are the redeliveries of what earlier
	// readers left unacknowledged (awaitEarlierReaders), in the order they
	// came due, which is not stream order when they came due at different
	// times: a delivery lost twice comes due after the ones behind it that
	// were lost once (the server sorts only what comes due together). Hold
	// them until all have come, or a first delivery shows there are no
	// more, or none came for a while (one may have left the stream), and
	// submit them in stream order.
	redelivery := r.toHold > 0 && md.NumDelivered > 1
	if r.toHold > 0 && !redelivery {
		r.releaseHeld(s)
	}
	if !r.cfg.Topology.Selects(r.c, m.Subject()) {
		_ = m.Ack()
		if r.onSkip != nil {
			r.onSkip(inbox.Settlement{Consumer: r.c.Name, Action: inbox.ActionSkipped, RecordID: strconv.FormatUint(md.Sequence.Stream, 10),
				Deliveries: int(md.NumDelivered)})
		}
		if redelivery {
			r.countHeld(s)
		}
		return
	}
	rec := r.c.record(m, md)
	if redelivery {
		r.held = append(r.held, rec)
		r.countHeld(s)
		return
	}
	s.Submit(rec)
}

// countHeld counts one expected redelivery as come (r.mu held).
func (r *Runner) countHeld(s *inbox.Session) {
	if r.toHold--; r.toHold == 0 {
		r.releaseHeld(s)
		return
	}
	quiet := pullHeartbeat(time.Duration(r.c.AckWait))
	r.holdUntil = time.Now().Add(quiet)
	r.holdTimer.Reset(quiet)
}

// releaseHeld submits the held redeliveries in stream order and ends the
// hold (r.mu held).
func (r *Runner) releaseHeld(s *inbox.Session) {
	if r.holdTimer != nil {
		r.holdTimer.Stop()
	}
	slices.SortFunc(r.held, func(a, b *inbox.Record) int {
		return cmp.Compare(a.Handle.(*delivery).md.Sequence.Stream, b.Handle.(*delivery).md.Sequence.Stream)
	})
	if len(r.held) > 0 {
		s.Submit(r.held...)
	}
	r.toHold, r.held = 0, nil
}

// releaseHeldOnQuiet runs when no redelivery came for a heartbeat while
// some were still expected: one of them left the stream (age, limits) or
// was settled meanwhile, and waiting longer would let the held ones
// expire.
func (r *Runner) releaseHeldOnQuiet() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.toHold == 0 || r.holdFor == nil || r.lost || time.Now().Before(r.holdUntil) {
		return // released, or a redelivery came as the timer fired (it is re-armed)
	}
	r.cfg.Logger.Info("nats consumer: fewer redeliveries came than were unacknowledged; applying those that came",
		"consumer", r.c.Name, "held", len(r.held), "missing", r.toHold)
	r.releaseHeld(r.holdFor)
}
