package nats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Settlement actions, as reported to ConsumerConfig.OnSettle.
const (
	ActionApplied    = "applied"     // the side effect ran and committed; acknowledged
	ActionDuplicate  = "duplicate"   // applied before; acknowledged
	ActionRetry      = "retry"       // transient failure: NakWithDelay
	ActionHeld       = "held"        // an earlier event of its aggregate is waiting for a retry: held in memory behind it
	ActionDeadLetter = "dead-letter" // sent to the dead-letter stream with the reason, then terminated
	ActionSkipped    = "skipped"     // the consumer's filters do not select it (servers before 2.10); acknowledged
)

// Settlement is what happened to one delivered message.
type Settlement struct {
	Consumer string
	// EventID is the event (or, for an invalid message, its Nats-Msg-Id).
	EventID string
	Action  string
	// Class is inbox.ClassTransient, ClassPermanent or ClassInvalid for
	// retries and dead letters.
	Class string
	// Deliveries counts the server's deliveries of the message, this one
	// included (1 the first time).
	Deliveries int
	// Subject and StreamSeq say where the message is in the stream.
	Subject   string
	StreamSeq uint64
	// Envelope is the decoded event (zero when invalid).
	Envelope envelope.Envelope
	Err      error
}

// ConsumerConfig configures a Runner.
type ConsumerConfig struct {
	// Consumer is the topology consumer's name (its inbox key). Required.
	Consumer string
	// HandlerTimeout bounds applying and settling one message; it must be
	// shorter than the consumer's AckWait. Default 30s, or AckWait/2 if that
	// is shorter.
	HandlerTimeout time.Duration
	// OnSettle, if set, is called after each message is settled (metrics, tests).
	OnSettle func(Settlement)
	// LogAggregateIDs adds aggregate ids to logs (FIFOBOX_LOG_AGGREGATE_IDS);
	// off by default because they may carry personal data.
	LogAggregateIDs bool
}

// ParkGrace is how long after a retry's delay an aggregate stays parked
// waiting for its head to come back. JetStream redelivers a nacked message
// itself, so this only matters if the head is lost (its stream purged, the
// server's MaxDeliver reached): it bounds how long later events are held.
const ParkGrace = 15 * time.Minute

// delivery is one message as delivered.
type delivery struct {
	m         jetstream.Msg
	md        *jetstream.MsgMetadata
	env       envelope.Envelope
	decodeErr error
}

func (d *delivery) seq() uint64 { return d.md.Sequence.Stream }

// key is the delivery's ordering key: its aggregate, or its stream sequence
// when invalid.
func (d *delivery) key() string {
	if d.decodeErr != nil {
		return "invalid/" + strconv.FormatUint(d.seq(), 10)
	}
	return d.env.AggregateType + "\x00" + d.env.AggregateID
}

// park is an aggregate whose head event waits for a retry (NakWithDelay):
// the aggregate's later messages, delivered meanwhile, are held here unacked
// (the runner keeps them in progress) and applied in order once the head
// is settled.
type park struct {
	headSeq uint64
	until   time.Time // when the head is due back
	held    []*delivery
}

// settler applies delivered messages and settles them by the verdict.
//
// Ordering across retries: a nacked message is redelivered after its delay
// while the consumer goes on delivering later messages, so left alone the
// next event of its aggregate would overtake it. The settler parks the
// aggregate instead: while its head waits for a retry, every later message
// of that aggregate is held in memory, unacknowledged (in-progress extends
// its AckWait), and when the head succeeds or is dead-lettered the held
// messages are applied in their order. Other aggregates are not held up.
// Held messages count towards MaxAckPending, which bounds the memory: when
// it is reached the server delivers nothing more until heads settle.
type settler struct {
	topo *Topology
	c    Consumer
	db   inbox.DB
	fn   inbox.Apply
	dlq  *sender
	cc   ConsumerConfig
	log  *slog.Logger

	mu    sync.Mutex
	parks map[string]*park
}

func newSettler(cfg *Config, db inbox.DB, apply inbox.Apply, cc ConsumerConfig, dlq *sender) (*settler, error) {
	switch {
	case db == nil:
		return nil, errors.New("db is nil")
	case apply == nil:
		return nil, errors.New("apply is nil")
	}
	c, ok := cfg.Topology.Consumer(cc.Consumer)
	if !ok {
		return nil, fmt.Errorf("consumer %q is not in the topology", cc.Consumer)
	}
	if cc.HandlerTimeout == 0 {
		cc.HandlerTimeout = min(30*time.Second, time.Duration(c.AckWait)/2)
	}
	if cc.HandlerTimeout >= time.Duration(c.AckWait) {
		return nil, fmt.Errorf("HandlerTimeout %s: must be shorter than consumer %s's ack_wait %s, or the server redelivers messages still being applied",
			cc.HandlerTimeout, c.Name, time.Duration(c.AckWait))
	}
	return &settler{topo: &cfg.Topology, c: c, db: db, fn: apply, dlq: dlq, cc: cc, log: cfg.Logger, parks: map[string]*park{}}, nil
}

func (s *settler) settled(st Settlement) {
	if s.cc.OnSettle != nil {
		s.cc.OnSettle(st)
	}
}

func (s *settler) settlement(d *delivery) Settlement {
	st := Settlement{Consumer: s.c.Name, EventID: d.m.Headers().Get(HeaderMsgID), Deliveries: int(d.md.NumDelivered),
		Subject: d.m.Subject(), StreamSeq: d.seq(), Envelope: d.env}
	if d.decodeErr == nil {
		st.EventID = d.env.ID
	}
	return st
}

// handle runs on d's lane: it holds d behind its aggregate's retrying head,
// or applies and settles it and then whatever was held behind it.
func (s *settler) handle(ctx context.Context, d *delivery) {
	key := d.key()
	s.mu.Lock()
	if p := s.parks[key]; p != nil && p.headSeq != d.seq() {
		replaced := false
		for i, h := range p.held {
			if h.seq() == d.seq() { // redelivered after all: keep the newest handle
				p.held[i], replaced = d, true
			}
		}
		if !replaced {
			p.held = append(p.held, d)
		}
		s.mu.Unlock()
		st := s.settlement(d)
		st.Action = ActionHeld
		s.settled(st)
		return
	}
	s.mu.Unlock()
	s.apply(ctx, d)
	s.drain(ctx, key)
}

// drain applies, in order, the messages held behind key's head once the
// head has settled, until one of them parks the aggregate again.
func (s *settler) drain(ctx context.Context, key string) {
	for {
		s.mu.Lock()
		p := s.parks[key]
		if p == nil || p.headSeq != 0 || len(p.held) == 0 {
			if p != nil && p.headSeq == 0 {
				delete(s.parks, key)
			}
			s.mu.Unlock()
			return
		}
		next := p.held[0]
		p.held = p.held[1:]
		p.headSeq = next.seq() // applying it now: it is the head until settled
		s.mu.Unlock()
		s.apply(ctx, next)
	}
}

// apply processes d through the inbox and settles it. On return the
// aggregate is parked with d as head (d is waiting for a retry), or its
// park (if any) has headSeq 0: d is settled and held messages may go.
func (s *settler) apply(parent context.Context, d *delivery) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(parent), s.cc.HandlerTimeout)
	defer cancel()
	st := s.settlement(d)
	key := d.key()
	release := func() {
		s.mu.Lock()
		if p := s.parks[key]; p != nil {
			p.headSeq = 0
		}
		s.mu.Unlock()
	}
	parkFor := func(delay time.Duration) {
		s.mu.Lock()
		p := s.parks[key]
		if p == nil {
			p = &park{}
			s.parks[key] = p
		}
		p.headSeq, p.until = d.seq(), time.Now().Add(delay)
		s.mu.Unlock()
	}

	if d.decodeErr != nil {
		st.Action, st.Class, st.Err = ActionDeadLetter, inbox.ClassInvalid, d.decodeErr
		if !s.deadLetter(ctx, d, inbox.ClassInvalid, d.decodeErr, parkFor) {
			return
		}
		s.settled(st)
		return
	}
	res := transport.ProcessEnvelope(ctx, s.db, s.c.Name, d.env, s.fn)
	st.Class, st.Err = res.Class, res.Err
	switch res.Verdict {
	case transport.Ack:
		st.Action = ActionApplied
		if res.Outcome == inbox.Duplicate {
			st.Action = ActionDuplicate
		}
		if err := d.m.Ack(); err != nil {
			// Redelivered later; the inbox knows it was applied.
			s.log.Warn("nats consumer: acknowledgement not sent", "consumer", s.c.Name, "event_id", d.env.ID, "error", err.Error())
		}
		release()
		s.settled(st)
		return
	case transport.DeadLetter:
		st.Action = ActionDeadLetter
		if !s.deadLetter(ctx, d, res.Class, res.Err, parkFor) {
			return
		}
		release()
		s.settled(st)
		return
	}
	// Retry, or dead-letter once the retries are used up (or the server
	// would not deliver it again).
	n := int(d.md.NumDelivered)
	if n > s.c.Retry.MaxRetries || (s.c.MaxDeliver > 0 && n >= s.c.MaxDeliver) {
		st.Action = ActionDeadLetter
		cause := fmt.Errorf("failed after %d retries: %w", n-1, res.Err)
		if !s.deadLetter(ctx, d, inbox.ClassTransient, cause, parkFor) {
			return
		}
		release()
		s.settled(st)
		return
	}
	delay := s.c.Retry.Delay(n)
	st.Action = ActionRetry
	parkFor(delay)
	if err := d.m.NakWithDelay(delay); err != nil {
		// Not sent: the server redelivers after AckWait instead; the
		// aggregate stays parked until then.
		s.log.Warn("nats consumer: nak not sent; the message comes back after ack_wait", "consumer", s.c.Name, "event_id", d.env.ID, "error", err.Error())
		parkFor(time.Duration(s.c.AckWait))
	}
	s.log.Warn("nats consumer: event failed; retrying after a delay", append(s.aggAttrs(d), "consumer", s.c.Name,
		"event_id", d.env.ID, "sequence", d.env.Sequence, "retry", n, "delay", delay.String(), "error", res.Err.Error())...)
	s.settled(st)
}

// deadLetter sends d to the dead-letter stream with the reason and then
// terminates it. If the dead-letter stream does not take it, d cannot be
// settled: it is nacked for a short while and stays its aggregate's head,
// so nothing overtakes it. It reports whether d was settled.
func (s *settler) deadLetter(ctx context.Context, d *delivery, class string, cause error, parkFor func(time.Duration)) bool {
	reason := cause.Error()
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	h := natsgo.Header{}
	for k, v := range d.m.Headers() {
		if !strings.HasPrefix(strings.ToLower(k), "nats-") {
			h[k] = v
		}
	}
	h[HeaderErrorClass] = []string{class}
	h[HeaderErrorReason] = []string{headerValue(reason)}
	h[HeaderConsumer] = []string{s.c.Name}
	h[HeaderDeadAt] = []string{time.Now().UTC().Format(time.RFC3339Nano)}
	h[HeaderDeliveries] = []string{strconv.FormatUint(d.md.NumDelivered, 10)}
	h[HeaderSubject] = []string{d.m.Subject()}
	h[HeaderStreamSeq] = []string{strconv.FormatUint(d.seq(), 10)}
	// One id per (consumer, stream message): a resend after a lost PubAck is
	// dropped by the dead-letter stream's duplicate window.
	h[HeaderMsgID] = []string{fmt.Sprintf("%s:%s:%d", s.c.Name, s.topo.Stream, d.seq())}
	msg := &natsgo.Msg{Subject: s.topo.DLQSubject(s.c), Data: d.m.Data(), Header: h}
	if err := s.dlq.sendOne(ctx, outgoing{msg: msg, stream: s.topo.DeadLetterStream}); err != nil {
		wait := time.Duration(s.c.Retry.InitialDelay)
		parkFor(wait)
		_ = d.m.NakWithDelay(wait)
		s.log.Warn("nats consumer: could not dead-letter a message; it will be redelivered", "consumer", s.c.Name,
			"stream_seq", d.seq(), "class", class, "error", err.Error())
		return false
	}
	if err := d.m.Term(); err != nil {
		// Redelivered later and dead-lettered again; the dead-letter
		// stream drops the copy inside its duplicate window.
		s.log.Warn("nats consumer: term not sent", "consumer", s.c.Name, "stream_seq", d.seq(), "error", err.Error())
	}
	s.log.Error("nats consumer: message sent to the dead-letter stream", append(s.aggAttrs(d), "consumer", s.c.Name,
		"event_id", s.settlement(d).EventID, "stream_seq", d.seq(), "class", class, "reason", reason)...)
	return true
}

func (s *settler) aggAttrs(d *delivery) []any {
	if !s.cc.LogAggregateIDs || d.decodeErr != nil {
		return nil
	}
	return []any{"aggregate_type", d.env.AggregateType, "aggregate_id", d.env.AggregateID}
}

// tend keeps held messages in progress (so AckWait does not expire them)
// and returns the keys whose head is overdue by more than ParkGrace: their
// held messages should be released.
func (s *settler) tend() (overdue []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	for key, p := range s.parks {
		if p.headSeq != 0 && now.After(p.until.Add(ParkGrace)) {
			overdue = append(overdue, key)
			continue
		}
		for _, h := range p.held {
			_ = h.m.InProgress()
		}
	}
	return overdue
}

// releaseOverdue is run on key's lane: the head never came back, so its
// held messages go ahead.
func (s *settler) releaseOverdue(ctx context.Context, key string) {
	s.mu.Lock()
	p := s.parks[key]
	if p == nil || p.headSeq == 0 || time.Now().Before(p.until.Add(ParkGrace)) {
		s.mu.Unlock()
		return
	}
	s.log.Warn("nats consumer: an aggregate's retrying event did not come back in time; releasing its later events",
		"consumer", s.c.Name, "head_stream_seq", p.headSeq, "held", len(p.held))
	p.headSeq = 0
	s.mu.Unlock()
	s.drain(ctx, key)
}

// abandon ends a session's parks: held messages are nacked to come back
// just after their head (best effort; without it they come back after
// AckWait), and the parks are forgotten.
func (s *settler) abandon() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key, p := range s.parks {
		delay := max(time.Until(p.until), 0) + 200*time.Millisecond
		for _, h := range p.held {
			_ = h.m.NakWithDelay(delay)
		}
		delete(s.parks, key)
	}
}
