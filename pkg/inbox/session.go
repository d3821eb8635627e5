package inbox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Session is one stretch of consuming through a broker connection: the
// transport submits what it receives, the engine applies it on per-group
// lanes and settles it through the Broker. A runner opens a session per
// broker connection (Engine.Start); a Lambda handler runs one per
// invocation (Engine.Handle).
type Session struct {
	e      *Engine
	broker Broker
	ctx    context.Context // for database and broker calls; never cancelled by Stop
	stopAt time.Time       // Lambda: start nothing after this (zero: no deadline)
	// waitUntil bounds how long a batch waits in place for the database
	// (zero: as long as the session lasts); past it the batch's records are
	// handed back as at a deadline.
	waitUntil time.Time
	onFail    func(error)

	lanes []*lane
	wg    sync.WaitGroup
	// solo is held exclusively while a redelivered record runs alone
	// (charged, run.go) and shared by every other batch: a consumer that
	// dies then was running that record and nothing else, so the death is
	// charged to it alone.
	solo sync.RWMutex

	mu       sync.Mutex
	inHand   map[*Record]struct{}
	nextSeq  uint64
	stopping bool // Stop: give up waiting on the database, start no new batch
	drain    bool // with stopping: still finish what is queued
	closing  bool // Close: finish everything, then end

	failed  atomic.Bool
	failErr error
	// halt is closed when the session stops or fails: batches waiting on
	// the database give up.
	halt     chan struct{}
	haltOnce sync.Once

	keepStop chan struct{}
	keepDone chan struct{}
}

// lane applies one share of the groups, one batch at a time.
type lane struct {
	s     *Session
	mu    sync.Mutex
	wake  chan struct{}
	queue []*Record
	// held (HoldDeferred): per group, records waiting in memory behind the
	// group's retrying head.
	held map[string]*heldGroup
}

type heldGroup struct {
	head    string // the head's key
	expires time.Time
	recs    []*Record
}

// Start opens a session: records submitted to it are applied and settled
// through b until Stop. onFail (may be nil) is called once if b fails to
// settle a record; the session then settles nothing more, and the transport
// should end it (Stop) and let the broker redeliver what is unsettled.
// ctx carries values for database and broker calls; ending it does not end
// the session (Stop does).
func (e *Engine) Start(ctx context.Context, b Broker, onFail func(error)) *Session {
	return e.start(ctx, b, time.Time{}, time.Time{}, onFail)
}

func (e *Engine) start(ctx context.Context, b Broker, stopAt, waitUntil time.Time, onFail func(error)) *Session {
	s := &Session{e: e, broker: b, ctx: context.WithoutCancel(ctx), stopAt: stopAt, waitUntil: waitUntil, onFail: onFail,
		inHand: map[*Record]struct{}{}, halt: make(chan struct{}), keepStop: make(chan struct{}), keepDone: make(chan struct{})}
	s.lanes = make([]*lane, e.cfg.Lanes)
	for i := range s.lanes {
		l := &lane{s: s, wake: make(chan struct{}, 1), held: map[string]*heldGroup{}}
		s.lanes[i] = l
		s.wg.Add(1)
		go func() { defer s.wg.Done(); l.run() }()
	}
	go s.keep()
	return s
}

// Handle applies one Lambda invocation's records and settles each through
// b before it returns. A batch whose database work fails waits in place
// for the database until DeadlineMargin before ctx's deadline (not at all
// when ctx has none) and is then handed back like the records not started. Lanes run concurrently; within a group records run
// in the order given. Once ctx's deadline is within DeadlineMargin no
// record is started: the rest are handed to b.Retry behind nothing newer of
// their group (their groups parked in the database unless the broker keeps
// group order itself), without counting a failure. The error is non-nil
// when a record could not be settled (a broker call failed, or the
// database was needed for the deadline's parking and did not answer): the
// caller fails the invocation and the event source redelivers the batch,
// whose records the inbox state then recognises.
func (e *Engine) Handle(ctx context.Context, b Broker, recs []*Record) error {
	// Without a deadline (a caller that is not a Lambda invocation) a batch
	// does not wait for the database: its records are handed back at once.
	stopAt, waitUntil := time.Time{}, time.Now()
	if dl, ok := ctx.Deadline(); ok {
		stopAt = dl.Add(-e.cfg.DeadlineMargin)
		waitUntil = stopAt
	}
	var mu sync.Mutex
	var first error
	s := e.start(ctx, b, stopAt, waitUntil, func(err error) {
		mu.Lock()
		if first == nil {
			first = err
		}
		mu.Unlock()
	})
	s.Submit(recs...)
	s.Close()
	mu.Lock()
	defer mu.Unlock()
	return first
}

// Submit decodes records and queues each on its group's lane, in order.
// Records submitted in one call are queued before any of them starts, so a
// lane takes them in one batch (a Lambda invocation's records).
func (s *Session) Submit(records ...*Record) {
	s.mu.Lock()
	for _, r := range records {
		r.decode()
		s.nextSeq++
		r.seq = s.nextSeq
		s.inHand[r] = struct{}{}
	}
	s.mu.Unlock()
	perLane := map[*lane][]*Record{}
	for _, r := range records {
		l := s.lanes[laneOf(r.laneKey(), len(s.lanes))]
		perLane[l] = append(perLane[l], r)
	}
	for l, rs := range perLane {
		l.mu.Lock()
		l.queue = append(l.queue, rs...)
		l.mu.Unlock()
		l.poke()
	}
}

// Stop ends the session: drain true finishes what is queued (a graceful
// shutdown), false only the batches already running (the connection is
// gone). Waiting on an unreachable database is given up either way. It
// returns the records left unsettled (queued, held behind a retrying head,
// or not settled when the session failed), in the order they were
// submitted, for the transport to hand back to the broker.
func (s *Session) Stop(drain bool) []*Record {
	s.mu.Lock()
	s.stopping, s.drain = true, drain
	s.mu.Unlock()
	s.haltOnce.Do(func() { close(s.halt) })
	return s.end()
}

// Close finishes everything submitted (waiting on the database as long as
// the deadline allows) and ends the session; it returns what is unsettled.
func (s *Session) Close() []*Record {
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	return s.end()
}

func (s *Session) end() []*Record {
	for _, l := range s.lanes {
		l.poke()
	}
	s.wg.Wait()
	close(s.keepStop)
	<-s.keepDone
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Record, 0, len(s.inHand))
	for r := range s.inHand {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].seq < out[j].seq })
	return out
}

// Err is the broker error that failed the session, if any.
func (s *Session) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failErr
}

func (s *Session) fail(err error) {
	s.mu.Lock()
	first := s.failErr == nil
	if first {
		s.failErr = err
	}
	s.mu.Unlock()
	s.failed.Store(true)
	s.haltOnce.Do(func() { close(s.halt) })
	if first && s.onFail != nil {
		s.onFail(err)
	}
}

// state reports whether lanes should give up (stopping and not draining)
// and whether they may end once their queue is empty.
func (s *Session) state() (abandon, ending bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return (s.stopping && !s.drain) || s.failed.Load(), s.stopping || s.closing
}

// givingUp reports whether a batch waiting on the database should stop
// waiting: the session is stopping, or failed.
func (s *Session) givingUp() bool {
	select {
	case <-s.halt:
		return true
	default:
		return false
	}
}

// pastDeadline reports whether no record may be started any more.
func (s *Session) pastDeadline() bool {
	return !s.stopAt.IsZero() && !time.Now().Before(s.stopAt)
}

// deadlineCheck is pastDeadline, or nil when the session has no deadline.
func (s *Session) deadlineCheck() func() bool {
	if s.stopAt.IsZero() {
		return nil
	}
	return s.pastDeadline
}

// settled drops r from the records in hand.
func (s *Session) settled(r *Record) {
	s.mu.Lock()
	delete(s.inHand, r)
	s.mu.Unlock()
}

// keep calls the broker's KeepAlive for everything in hand, and releases
// groups held in memory whose head is overdue.
func (s *Session) keep() {
	defer close(s.keepDone)
	k, _ := s.broker.(Keeper)
	every := time.Second
	if k != nil {
		every = min(every, max(k.KeepAliveEvery(), 10*time.Millisecond))
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.keepStop:
			return
		case <-t.C:
		}
		if k != nil {
			s.mu.Lock()
			rs := make([]*Record, 0, len(s.inHand))
			for r := range s.inHand {
				rs = append(rs, r)
			}
			s.mu.Unlock()
			if len(rs) > 0 {
				sort.Slice(rs, func(i, j int) bool { return rs[i].seq < rs[j].seq })
				k.KeepAlive(s.ctx, rs)
			}
		}
		if s.e.cfg.HoldDeferred {
			for _, l := range s.lanes {
				l.releaseOverdue()
			}
		}
	}
}

// laneOf is the lane (0..n-1) that key maps to: FNV-1a, the same in every
// process.
func laneOf(key string, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

func (l *lane) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// run takes the lane's waiting records a batch at a time until the session ends.
func (l *lane) run() {
	for {
		abandon, ending := l.s.state()
		if abandon {
			return
		}
		l.mu.Lock()
		n := min(len(l.queue), l.s.e.cfg.MaxBatch)
		// A redelivered record runs alone (Engine: a crash is charged only
		// to an event that was running alone).
		for i, r := range l.queue[:n] {
			if r.redelivered() {
				n = max(i, 1)
				break
			}
		}
		batch := append([]*Record(nil), l.queue[:n]...)
		l.queue = l.queue[n:]
		l.mu.Unlock()
		if n == 0 {
			if ending {
				return
			}
			<-l.wake
			continue
		}
		if !l.process(batch) {
			return
		}
	}
}

// front puts records back at the head of the lane's queue (in their order):
// a group's held records, released when its head settled, come before
// anything of the group queued after them.
func (l *lane) front(rs []*Record) {
	if len(rs) == 0 {
		return
	}
	l.mu.Lock()
	l.queue = append(append([]*Record(nil), rs...), l.queue...)
	l.mu.Unlock()
	l.poke()
}

// waitBehindHeld takes out of batch the records whose group is held in
// memory behind a retrying head that is not them: they join the held records.
func (l *lane) waitBehindHeld(batch []*Record) []*Record {
	if !l.s.e.cfg.HoldDeferred {
		return batch
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.held) == 0 {
		return batch
	}
	out := batch[:0:0]
	for _, r := range batch {
		if h := l.held[r.group]; h != nil && r.group != "" && h.head != r.key {
			h.recs = append(h.recs, r)
			l.s.report(r, Settlement{Action: ActionDeferred, Class: ClassBlocked, Failures: r.Failures})
			continue
		}
		out = append(out, r)
	}
	return out
}

// hold keeps r in memory behind its group's head.
func (l *lane) hold(r *Record, head string, expires time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	h := l.held[r.group]
	if h == nil {
		h = &heldGroup{head: head}
		l.held[r.group] = h
	}
	h.expires = expires
	h.recs = append(h.recs, r)
}

// extend moves a held group's expiry: its head is waiting for another retry.
func (l *lane) extend(group string, expires time.Time) {
	l.mu.Lock()
	if h := l.held[group]; h != nil {
		h.expires = expires
	}
	l.mu.Unlock()
}

// release sends a group's held records back through the lane, first.
func (l *lane) release(group string) {
	l.mu.Lock()
	h := l.held[group]
	delete(l.held, group)
	l.mu.Unlock()
	if h != nil {
		l.front(h.recs)
	}
}

// releaseOverdue releases groups whose head is overdue beyond ParkGrace.
func (l *lane) releaseOverdue() {
	now := time.Now()
	l.mu.Lock()
	var due []string
	for g, h := range l.held {
		if now.After(h.expires) {
			due = append(due, g)
		}
	}
	l.mu.Unlock()
	for _, g := range due {
		l.s.e.log.Warn("inbox engine: a group's retrying event did not come back in time; its later events go ahead",
			"consumer", l.s.e.cfg.Consumer)
		l.release(g)
	}
}

// process applies one batch, waiting out database failures, and settles
// it. It returns false when the lane should end: the session stopped while
// the batch waited on the database (the batch is left unsettled).
func (l *lane) process(batch []*Record) bool {
	s := l.s
	batch = l.waitBehindHeld(batch)
	if len(batch) == 0 {
		return true
	}
	wait := 100 * time.Millisecond
	var since time.Time
	pre := map[*Record]error{}
	handBack := false // waited as long as allowed: only hand the records back
	for {
		deadline := handBack || s.pastDeadline()
		alone := !deadline && len(batch) == 1 && batch[0].redelivered()
		if alone {
			s.solo.Lock()
		} else {
			s.solo.RLock()
		}
		ds, err := s.e.run(s.ctx, batch, deadline, pre, s.deadlineCheck())
		if alone {
			s.solo.Unlock()
		} else {
			s.solo.RUnlock()
		}
		if err == nil {
			if !since.IsZero() {
				s.e.log.Info("inbox engine: the database answers again; batch applied", "consumer", s.e.cfg.Consumer,
					"records", len(batch), "waited", time.Since(since).Round(time.Millisecond).String())
			}
			l.settle(batch, ds)
			return true
		}
		if errors.Is(err, errRunAgain) {
			continue // a record timed out and broke the transaction: run the rest again now
		}
		if deadline {
			// Not even the deadline's bookkeeping could be written.
			if s.e.cfg.OrderedRedelivery {
				l.settle(batch, unfinishedDecisions(batch, ClassDeadline))
				return true
			}
			s.fail(fmt.Errorf("inbox engine: records not finished before the deadline could not be parked: %w", err))
			return false
		}
		if s.givingUp() {
			return false // unsettled: the transport hands them back to the broker
		}
		if !s.waitUntil.IsZero() && !time.Now().Before(s.waitUntil) {
			if s.e.cfg.OrderedRedelivery {
				l.settle(batch, unfinishedDecisions(batch, ClassTransient))
				return true
			}
			handBack = true
			continue
		}
		if since.IsZero() {
			since = time.Now()
			s.e.log.Warn("inbox engine: the batch's database work failed; retrying it in place (no retry budget spent)",
				"consumer", s.e.cfg.Consumer, "records", len(batch), "error", err.Error())
		}
		pause := wait
		if !s.waitUntil.IsZero() {
			pause = min(pause, max(time.Until(s.waitUntil), 0))
		}
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-s.halt:
			t.Stop()
			return false
		}
		wait = min(wait*2, s.e.cfg.InfraRetryMax)
	}
}

// settle carries out the batch's decisions through the broker, in order.
func (l *lane) settle(batch []*Record, ds []decision) {
	s := l.s
	var release []string
	for i, r := range batch {
		d := ds[i]
		if s.failed.Load() {
			return
		}
		if d.action == ActionDeferred && s.e.cfg.HoldDeferred && d.retry.Behind != "" {
			l.hold(r, d.retry.Behind, d.expires)
			s.report(r, d.settlement())
			continue
		}
		var err error
		ctx, cancel := context.WithTimeout(s.ctx, s.e.cfg.HandlerTimeout)
		switch d.action {
		case ActionApplied, ActionDuplicate:
			err = s.broker.Ack(ctx, r)
		case ActionRetry, ActionDeferred:
			err = s.broker.Retry(ctx, r, d.retry)
		case ActionDeadLetter, ActionHeld:
			err = s.broker.DeadLetter(ctx, r, d.dead)
		}
		cancel()
		if err != nil {
			s.e.log.Warn("inbox engine: could not settle a record; the broker redelivers it", s.e.attrs(r, "action", d.action, "error", err.Error())...)
			s.fail(fmt.Errorf("settle %s (%s): %w", r.ID, d.action, err))
			return
		}
		s.report(r, d.settlement())
		s.settled(r)
		if s.e.cfg.HoldDeferred {
			if d.releases {
				release = append(release, r.group)
			} else if d.action == ActionRetry {
				l.extend(r.group, d.expires)
			}
		}
	}
	for _, g := range release {
		l.release(g)
	}
}

// report calls OnSettle.
func (s *Session) report(r *Record, st Settlement) {
	if s.e.cfg.OnSettle == nil {
		return
	}
	st.Consumer, st.RecordID, st.EventID, st.Deliveries, st.Envelope, st.Record = s.e.cfg.Consumer, r.ID, r.EventID(), r.Deliveries, r.env, r
	s.e.cfg.OnSettle(st)
}
