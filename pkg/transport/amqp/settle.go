package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Settlement actions, as reported to ConsumerConfig.OnSettle.
const (
	ActionApplied    = "applied"     // the side effect ran and committed
	ActionDuplicate  = "duplicate"   // applied before; nothing done
	ActionRetry      = "retry"       // transient failure: sent to a delay queue
	ActionForwarded  = "forwarded"   // an earlier event of its aggregate is waiting for a retry: sent behind it
	ActionDeadLetter = "dead-letter" // sent to the DLQ with the reason
)

// Settlement is what happened to one delivered message.
type Settlement struct {
	Consumer string
	// EventID is the event (or, for an invalid message, the AMQP message id).
	EventID string
	Action  string
	// Class is inbox.ClassTransient, ClassPermanent or ClassInvalid for
	// retries and dead letters.
	Class string
	// Attempts is the message's failed deliveries before this one.
	Attempts int
	// Envelope is the decoded event (zero when invalid).
	Envelope envelope.Envelope
	Err      error
}

// ConsumerConfig configures a Runner or LambdaHandler.
type ConsumerConfig struct {
	// Consumer is the topology consumer's name (its inbox key). Required.
	Consumer string
	// HandlerTimeout bounds applying one message, and committing and
	// settling a batch. Default 30s.
	HandlerTimeout time.Duration
	// MaxBatch is the most messages a lane applies in one transaction
	// (inbox.Batch): the lane's messages already waiting when it gets to
	// them, so batches form only under load and add no delay.
	// Default 16; 1 applies each message in its own transaction.
	MaxBatch int
	// OnSettle, if set, is called after each message is settled (metrics, tests).
	OnSettle func(Settlement)
	// LogAggregateIDs adds aggregate ids to logs (FIFOBOX_LOG_AGGREGATE_IDS);
	// off by default because they may carry personal data.
	LogAggregateIDs bool
}

// ParkGrace is how long after a retry's delay an aggregate stays parked
// waiting for its head to come back from the delay queue. It covers the time
// the head then waits in a backlogged queue; it bounds how long later events
// are held if the head is lost (a purged delay queue).
const ParkGrace = 15 * time.Minute

// settler applies delivered messages and settles them by the verdict: it is
// the part the local Runner and the Lambda handler share.
//
// Ordering across retries: RabbitMQ has no delayed redelivery, so a failed
// message waits in a delay queue and re-enters the consumer's queue at its
// tail. Left alone, the next event of its aggregate would overtake it. So the
// settler parks the aggregate: while its head waits for retry n, every later
// message of that aggregate is sent to the same delay queue behind it
// (queues are FIFO and share one TTL, so they come back in order). When the
// head succeeds or is dead-lettered, the aggregate is unparked. Parking is
// per lane (an aggregate always maps to the same lane) and in memory: a
// restart while a head is waiting loses it, and a later event may then
// overtake the head once (the inbox's per-aggregate order check, where
// configured, catches that).
type settler struct {
	topo *Topology
	c    Consumer
	db   inbox.DB
	fn   inbox.Apply
	out  *sender
	cc   ConsumerConfig
	log  *slog.Logger
	park []map[string]parked // per lane
}

type parked struct {
	head  string // the waiting event's id
	retry int    // the retry it waits for
	until time.Time
}

func newSettler(cfg *Config, db inbox.DB, apply inbox.Apply, cc ConsumerConfig, out *sender) (*settler, error) {
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
		cc.HandlerTimeout = 30 * time.Second
	}
	if cc.MaxBatch <= 0 {
		cc.MaxBatch = 16
	}
	s := &settler{topo: &cfg.Topology, c: c, db: db, fn: apply, out: out, cc: cc, log: cfg.Logger,
		park: make([]map[string]parked, c.Workers)}
	for i := range s.park {
		s.park[i] = map[string]parked{}
	}
	return s, nil
}

// delivery is one message as delivered, from AMQP or from a Lambda event.
type delivery struct {
	messageID string
	body      []byte
	headers   amqp091.Table
	props     amqp091.Publishing // properties to keep when re-publishing (no body, no headers)
	// decoded envelope, or why the body is not one
	env       envelope.Envelope
	decodeErr error
}

func (d *delivery) decode() {
	d.env, d.decodeErr = envelope.Decode(d.body)
}

// key is the delivery's ordering key: its aggregate, or its message id when invalid.
func (d *delivery) key() string {
	if d.decodeErr != nil {
		return "invalid/" + d.messageID
	}
	return d.env.AggregateType + "\x00" + d.env.AggregateID
}

func (s *settler) attempts(d *delivery) int { return headerInt(d.headers[s.topo.AttemptsHeader]) }

// errPoisoned: an earlier message of this session could not be settled, so
// later ones are left unsettled too (they are redelivered in order).
var errPoisoned = errors.New("amqp consumer: an earlier message could not be settled; leaving this one for redelivery")

// decide settles d on lane: it applies d with apply unless d is invalid or
// waits behind its parked aggregate's head, records the action in st,
// updates the lane's parked aggregates, and returns the publish d needs
// before it may be acknowledged (to a delay queue or the DLQ), or nil.
// Deciding before publishing lets a batch apply several messages, commit,
// and only then publish and acknowledge them in order.
func (s *settler) decide(lane int, d *delivery, st *Settlement, apply func() transport.Result) func(context.Context) error {
	if d.decodeErr != nil {
		st.Action, st.Class, st.Err = ActionDeadLetter, inbox.ClassInvalid, d.decodeErr
		return func(ctx context.Context) error { return s.deadLetter(ctx, d, inbox.ClassInvalid, d.decodeErr) }
	}
	st.EventID = d.env.ID
	key := d.key()
	parks := s.park[lane]
	p, isParked := parks[key]
	if isParked && time.Now().After(p.until) {
		s.log.Warn("amqp consumer: an aggregate's retrying event did not come back in time; releasing its later events",
			append(s.aggAttrs(d), "consumer", s.c.Name, "head_event_id", p.head)...)
		delete(parks, key)
		isParked = false
	}
	if isParked && p.head != d.env.ID {
		st.Action = ActionForwarded
		attempts := st.Attempts
		return func(ctx context.Context) error { return s.toRetryQueue(ctx, d, p.retry, attempts) }
	}

	res := apply()
	st.Class, st.Err = res.Class, res.Err
	switch res.Verdict {
	case transport.Ack:
		st.Action = ActionApplied
		if res.Outcome == inbox.Duplicate {
			st.Action = ActionDuplicate
		}
		delete(parks, key)
		return nil
	case transport.DeadLetter:
		st.Action = ActionDeadLetter
		delete(parks, key)
		return func(ctx context.Context) error { return s.deadLetter(ctx, d, res.Class, res.Err) }
	}
	// Retry, or dead-letter once the retries are used up.
	n := st.Attempts + 1
	if n > s.c.Retry.MaxRetries {
		st.Action = ActionDeadLetter
		cause := fmt.Errorf("failed after %d retries: %w", st.Attempts, res.Err)
		delete(parks, key)
		return func(ctx context.Context) error { return s.deadLetter(ctx, d, inbox.ClassTransient, cause) }
	}
	st.Action = ActionRetry
	parks[key] = parked{head: d.env.ID, retry: n, until: time.Now().Add(s.c.Retry.Delay(n) + ParkGrace)}
	return func(ctx context.Context) error {
		if err := s.toRetryQueue(ctx, d, n, n); err != nil {
			return err
		}
		s.log.Warn("amqp consumer: event failed; retrying after a delay", append(s.aggAttrs(d), "consumer", s.c.Name,
			"event_id", d.env.ID, "sequence", d.env.Sequence, "retry", n, "delay", s.c.Retry.Delay(n).String(), "error", res.Err.Error())...)
		return nil
	}
}

// pending is a delivered message waiting in its lane's batch, with the
// function that acknowledges it.
type pending struct {
	d   *delivery
	ack func() error
}

// batcher feeds a session's deliveries (the Runner's channel, or one
// Lambda invocation's records) to their lanes and applies each lane's
// waiting messages together: a message runs as soon as its lane reaches it,
// with whatever of the lane's messages queued up behind it meanwhile (up to
// MaxBatch), so batches form only under load and add no delay.
type batcher struct {
	s        *settler
	lanes    *transport.Lanes
	waiting  [][]pending // per lane; touched only by that lane's goroutine
	poisoned atomic.Bool // a message could not be settled: settle none after it
}

func (s *settler) newBatcher(lanes *transport.Lanes) *batcher {
	return &batcher{s: s, lanes: lanes, waiting: make([][]pending, lanes.Len())}
}

// submit queues d (acknowledged by ack once settled) on its aggregate's
// lane. failed receives handleBatch's error when a batch could not be
// settled (errPoisoned for those after it). It returns ctx's error if ctx
// ended while the lane was full (d then never runs).
func (b *batcher) submit(ctx context.Context, d *delivery, ack func() error, failed func(error)) error {
	return b.lanes.Submit(ctx, d.key(), func(lane int) {
		b.waiting[lane] = append(b.waiting[lane], pending{d: d, ack: ack})
		if b.lanes.Queued(lane) > 0 && len(b.waiting[lane]) < b.s.cc.MaxBatch {
			return // more of this lane's messages are queued: take them along
		}
		items := b.waiting[lane]
		b.waiting[lane] = nil
		if err := b.handleBatch(ctx, lane, items); err != nil {
			failed(err)
		}
	})
}

// handleBatch applies a lane's waiting messages in one transaction
// (inbox.Batch), commits, and only then settles each in delivery order:
// publish to a delay queue or the DLQ where needed, then acknowledge. If
// the commit fails nothing was applied, and every message that needed the
// database is settled as a transient failure instead (retry, behind its
// aggregate's head as usual). A nil error means every message was settled
// and acknowledged; an error means the rest must be redelivered (the caller
// ends the session; the inbox drops what was applied already).
func (b *batcher) handleBatch(ctx context.Context, lane int, items []pending) error {
	s, poisoned := b.s, &b.poisoned
	if poisoned.Load() {
		return errPoisoned
	}
	tx, err := inbox.NewBatch(s.db, s.c.Name)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	before := maps.Clone(s.park[lane])
	sts := make([]Settlement, len(items))
	sends := make([]func(context.Context) error, len(items))
	decideAll := func(apply func(d *delivery) transport.Result) {
		for i, it := range items {
			sts[i] = Settlement{Consumer: s.c.Name, EventID: it.d.messageID, Attempts: s.attempts(it.d), Envelope: it.d.env}
			sends[i] = s.decide(lane, it.d, &sts[i], func() transport.Result { return apply(it.d) })
		}
	}
	decideAll(func(d *delivery) transport.Result {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cc.HandlerTimeout)
		defer cancel()
		return transport.ProcessInBatch(actx, tx, d.env, s.fn)
	})
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cc.HandlerTimeout)
	defer cancel()
	if err := tx.Commit(sctx); err != nil {
		s.log.Warn("amqp consumer: a batch's commit failed; its messages are retried", "consumer", s.c.Name,
			"messages", len(items), "error", err.Error())
		s.park[lane] = before
		decideAll(func(d *delivery) transport.Result {
			return transport.Result{Verdict: transport.Retry, Class: inbox.ClassTransient, Err: err, Envelope: d.env}
		})
	}
	for i, it := range items {
		if sends[i] != nil {
			if err := sends[i](sctx); err != nil {
				poisoned.Store(true)
				s.log.Warn("amqp consumer: could not settle a message; it will be redelivered", "consumer", s.c.Name,
					"event_id", sts[i].EventID, "action", sts[i].Action, "error", err.Error())
				return err
			}
		}
		if err := it.ack(); err != nil {
			// The channel is gone: this message and the rest come back,
			// and the inbox knows which were applied.
			poisoned.Store(true)
			return nil
		}
		if s.cc.OnSettle != nil {
			s.cc.OnSettle(sts[i])
		}
	}
	return nil
}

func (s *settler) aggAttrs(d *delivery) []any {
	if !s.cc.LogAggregateIDs || d.decodeErr != nil {
		return nil
	}
	return []any{"aggregate_type", d.env.AggregateType, "aggregate_id", d.env.AggregateID}
}

// toRetryQueue sends d to retry n's delay queue with the attempts header set.
func (s *settler) toRetryQueue(ctx context.Context, d *delivery, n, attempts int) error {
	h := copyHeaders(d.headers, true)
	h[s.topo.AttemptsHeader] = int32(attempts)
	q := s.c.RetryQueueName(n)
	if err := s.out.sendOne(ctx, outgoing{exchange: s.c.SettleExchange(), key: q, msg: republish(d, h)}); err != nil {
		return fmt.Errorf("send to delay queue %s: %w", q, err)
	}
	return nil
}

// deadLetter sends d to the consumer's DLQ through its settle exchange,
// with the reason in x-fifobox-error-* headers.
func (s *settler) deadLetter(ctx context.Context, d *delivery, class string, cause error) error {
	reason := cause.Error()
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	h := copyHeaders(d.headers, false)
	h[HeaderErrorClass] = class
	h[HeaderErrorReason] = reason
	h[HeaderConsumer] = s.c.Name
	h[HeaderDeadAt] = time.Now().UTC().Format(time.RFC3339Nano)
	if err := s.out.sendOne(ctx, outgoing{exchange: s.c.SettleExchange(), key: s.c.DLQName(), msg: republish(d, h)}); err != nil {
		return fmt.Errorf("send to DLQ %s: %w", s.c.DLQName(), err)
	}
	s.log.Error("amqp consumer: message sent to the DLQ", append(s.aggAttrs(d), "consumer", s.c.Name, "event_id", d.messageID,
		"class", class, "reason", reason)...)
	return nil
}

// republish is d as a persistent message with headers h.
func republish(d *delivery, h amqp091.Table) amqp091.Publishing {
	p := d.props
	p.Headers = h
	p.Body = d.body
	p.DeliveryMode = amqp091.Persistent
	if p.MessageId == "" {
		p.MessageId = d.messageID
	}
	return p
}

// copyHeaders copies h; dropDeath leaves out the broker's x-death history
// (it restarts with the next dead-lettering) and the client-set
// x-first-death / x-last-death summaries.
func copyHeaders(h amqp091.Table, dropDeath bool) amqp091.Table {
	out := make(amqp091.Table, len(h)+4)
	for k, v := range h {
		if dropDeath && (k == "x-death" || strings.HasPrefix(k, "x-first-death-") || strings.HasPrefix(k, "x-last-death-")) {
			continue
		}
		out[k] = v
	}
	return out
}

// headerInt reads an integer header however it was encoded (AMQP integer
// types, a JSON number from a Lambda event, a string).
func headerInt(v any) int {
	switch x := v.(type) {
	case int8:
		return int(x)
	case int16:
		return int(x)
	case int32:
		return int(x)
	case int64:
		return int(x)
	case int:
		return x
	case uint8:
		return int(x)
	case uint16:
		return int(x)
	case uint32:
		return int(x)
	case float64:
		if x >= 0 && x < math.MaxInt32 {
			return int(x)
		}
	case string:
		n, _ := strconv.Atoi(x)
		return n
	case []byte:
		n, _ := strconv.Atoi(string(x))
		return n
	}
	return 0
}
