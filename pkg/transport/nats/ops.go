package nats

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/redact"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Operations are the server-side operator actions.
type Operations struct {
	cfg Config
	out *sender
}

var _ transport.Operations = (*Operations)(nil)

// NewOperations returns Operations for cfg's topology.
func NewOperations(cfg Config) (*Operations, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new nats operations: %w", err)
	}
	o := &Operations{cfg: cfg}
	o.out = newSender(&o.cfg, "operations")
	return o, nil
}

// Close closes the connection.
func (o *Operations) Close() error { return o.out.close() }

// redriveBatch is how many dead letters one redrive step reads.
const redriveBatch = 100

func (o *Operations) consumer(name string) (Consumer, error) {
	c, ok := o.cfg.Topology.Consumer(name)
	if !ok {
		return Consumer{}, fmt.Errorf("consumer %q is not in the topology", name)
	}
	return c, nil
}

// Depths reports per consumer: Ready, the messages the consumer has not
// been delivered yet (its num_pending; on servers before 2.10 this counts
// every event in the stream the consumer has not passed, whether its filters
// select it or not); InFlight, delivered and unacknowledged (num_ack_pending,
// including messages held behind a retrying event and those waiting out a
// NakWithDelay); Retrying, those of them delivered more than once
// (num_redelivered); DLQ, the consumer's messages in the dead-letter
// stream; Consumers, the pull requests waiting (about one per idle runner).
func (o *Operations) Depths(ctx context.Context, consumers ...string) ([]transport.QueueDepth, error) {
	names := consumers
	if len(names) == 0 {
		for _, c := range o.cfg.Topology.Consumers {
			names = append(names, c.Name)
		}
	}
	t := &o.cfg.Topology
	_, js, connErr := o.out.conn.get(ctx, o.cfg.ConnectWait)
	var dlqCounts map[string]uint64
	var dlqErr error
	if connErr == nil {
		if dlq, err := js.Stream(ctx, t.DeadLetterStream); err != nil {
			dlqErr = err
		} else if info, err := dlq.Info(ctx, jetstream.WithSubjectFilter(t.dlqPrefix()+".>")); err != nil {
			dlqErr = err
		} else {
			dlqCounts = info.State.Subjects
		}
	}
	var out []transport.QueueDepth
	for _, name := range names {
		d := transport.QueueDepth{Consumer: name, Ready: -1, InFlight: -1, Retrying: -1, DLQ: -1, DLQInFlight: -1,
			SubscriptionDLQState: transport.StateNone}
		c, err := o.consumer(name)
		switch {
		case err != nil:
			d.QueueState, d.DLQState, d.Error = transport.StateMissing, transport.StateMissing, err.Error()
			out = append(out, d)
			continue
		case connErr != nil:
			d.QueueState, d.DLQState = transport.StateUnreachable, transport.StateUnreachable
			d.Error = fmt.Sprintf("NATS %s unreachable: %v", redact.URL(o.cfg.URL), connErr)
			out = append(out, d)
			continue
		}
		d.Queue = t.Stream + "/" + c.Durable()
		var errs []string
		if ci, err := js.Consumer(ctx, t.Stream, c.Durable()); err != nil {
			errs = append(errs, fmt.Sprintf("consumer %s: %v", c.Durable(), err))
			d.QueueState = natsState(err)
		} else if info, err := ci.Info(ctx); err != nil {
			errs = append(errs, fmt.Sprintf("consumer %s: %v", c.Durable(), err))
			d.QueueState = natsState(err)
		} else {
			d.Ready, d.InFlight, d.Retrying, d.Consumers = int64(info.NumPending), int64(info.NumAckPending), int64(info.NumRedelivered), info.NumWaiting
			d.QueueState = transport.StateOK
		}
		if dlqErr != nil {
			errs = append(errs, fmt.Sprintf("dead-letter stream %s: %v", t.DeadLetterStream, dlqErr))
			d.DLQState = natsState(dlqErr)
		} else {
			d.DLQ, d.DLQInFlight, d.DLQState = int64(dlqCounts[t.DLQSubject(c)]), 0, transport.StateOK
		}
		d.Error = strings.Join(errs, "; ")
		out = append(out, d)
	}
	return out, nil
}

// natsState classifies a JetStream lookup's error.
func natsState(err error) transport.QueueState {
	switch {
	case err == nil:
		return transport.StateOK
	case errors.Is(err, jetstream.ErrConsumerNotFound), errors.Is(err, jetstream.ErrStreamNotFound):
		return transport.StateMissing
	case errors.Is(err, natsgo.ErrNoServers), errors.Is(err, natsgo.ErrConnectionClosed), errors.Is(err, natsgo.ErrTimeout),
		errors.Is(err, context.DeadlineExceeded), transport.Unreachable(err):
		return transport.StateUnreachable
	}
	return transport.StateError
}

// Redrive is transport.Operations.Redrive: the consumer's DLQ (the only
// dead-letter queue this transport has) through redrive, or in a dry run
// its depth.
func (o *Operations) Redrive(ctx context.Context, req transport.RedriveRequest) (transport.RedriveResult, error) {
	res := transport.RedriveResult{Waiting: -1, InFlight: 0}
	if req.From != "" && req.From != transport.ConsumerDLQ {
		return res, fmt.Errorf("redrive: %s: %w", req.From, transport.ErrNoSuchDLQ)
	}
	if req.Max < 1 {
		return res, errors.New("redrive: max must be at least 1")
	}
	c, err := o.consumer(req.Consumer)
	if err != nil {
		return res, fmt.Errorf("redrive: %w", err)
	}
	t := &o.cfg.Topology
	sel := transport.DLQSelection{Groups: req.Groups, Aggregates: req.Aggregates}
	total := int64(-1)
	if d, err := o.Depths(ctx, req.Consumer); err == nil && len(d) == 1 && d[0].DLQ >= 0 {
		res.Waiting = d[0].DLQ
		if sel.All() {
			total = min(d[0].DLQ, int64(req.Max))
		}
	}
	err = o.deadLetters(ctx, c, func(dlq jetstream.Stream, m *jetstream.RawStreamMsg) (bool, error) {
		if !sel.Matches(describeMsg(m, false)) {
			return false, nil
		}
		if !req.DryRun {
			t.redriven(&m.Header)
			rest := strings.TrimPrefix(m.Header.Get(HeaderSubject), t.SubjectPrefix+".")
			if rest == "" || rest == m.Header.Get(HeaderSubject) {
				rest = "redriven"
			}
			msg := &natsgo.Msg{Subject: t.ReplaySubjectPrefix(c) + "." + rest, Data: m.Data, Header: m.Header}
			msg.Header[HeaderMsgID] = []string{fmt.Sprintf("redrive:%s:%s:%d", c.Name, t.DeadLetterStream, m.Sequence)}
			if err := o.out.sendOne(ctx, outgoing{msg: msg, stream: t.Stream}); err != nil {
				return true, fmt.Errorf("send dead letter %d to %s (it stays dead): %w", m.Sequence, msg.Subject, err)
			}
			if err := dlq.DeleteMsg(ctx, m.Sequence); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
				return true, fmt.Errorf("delete dead letter %d (it was re-sent; the inbox drops copies): %w", m.Sequence, err)
			}
		}
		res.Moved++
		if req.Progress != nil && !req.DryRun && (res.Moved%redriveBatch == 0 || int64(res.Moved) == total) {
			req.Progress(int64(res.Moved), total)
		}
		return res.Moved >= req.Max, nil
	})
	if err != nil {
		return res, fmt.Errorf("redrive: after %d messages: %w", res.Moved, err)
	}
	res.Complete = true
	return res, nil
}

// deadLetters calls visit with c's dead letters in the order they died
// (dead-letter stream order), up to the stream's last message when it
// starts: what dies meanwhile waits for the next operation, so a redrive
// of a message that fails again ends instead of cycling. Reading a stream
// message takes nothing: it stays until deleted. visit's stop ends it.
// A redriven dead letter is a new stream message, so its delivery count,
// and with it the retry budget, starts afresh; its Nats-Msg-Id is derived
// from its dead-letter sequence, so a redrive that crashed between
// publishing and deleting re-publishes into the duplicate window and is
// dropped; after the window the inbox drops the copy.
func (o *Operations) deadLetters(ctx context.Context, c Consumer, visit func(jetstream.Stream, *jetstream.RawStreamMsg) (stop bool, err error)) error {
	_, js, err := o.out.conn.get(ctx, o.cfg.ConnectWait)
	if err != nil {
		return fmt.Errorf("NATS %s unreachable: %w", redact.URL(o.cfg.URL), err)
	}
	t := &o.cfg.Topology
	dlq, err := js.Stream(ctx, t.DeadLetterStream)
	if err != nil {
		return fmt.Errorf("dead-letter stream %s: %w", t.DeadLetterStream, err)
	}
	info, err := dlq.Info(ctx)
	if err != nil {
		return fmt.Errorf("dead-letter stream %s: %w", t.DeadLetterStream, err)
	}
	last := info.State.LastSeq
	subject := t.DLQSubject(c)
	for next := uint64(1); next <= last; {
		if err := ctx.Err(); err != nil {
			return err
		}
		// The next dead letter of this consumer at or after next, by sequence.
		m, err := dlq.GetMsg(ctx, next, jetstream.WithGetMsgSubject(subject))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read %s after sequence %d: %w", subject, next, err)
		}
		if m.Sequence > last {
			return nil
		}
		stop, err := visit(dlq, m)
		if err != nil || stop {
			return err
		}
		next = m.Sequence + 1
	}
	return nil
}

// describeMsg is a dead letter as an operator sees it.
func describeMsg(m *jetstream.RawStreamMsg, body bool) transport.DLQMessage {
	d := transport.DLQMessage{ID: strconv.FormatUint(m.Sequence, 10), Group: m.Header.Get(HeaderAggregateID),
		ErrorClass: m.Header.Get(HeaderErrorClass), ErrorReason: m.Header.Get(HeaderErrorReason)}
	d.Describe(m.Data)
	if t, err := time.Parse(time.RFC3339Nano, m.Header.Get(HeaderDeadAt)); err == nil {
		d.DeadAt = &t
	}
	if body {
		d.Body = string(m.Data)
	}
	return d
}

// Peek lists the consumer's dead letters (transport.Operations.Peek):
// reading a stream takes nothing, so every one stays where it is.
func (o *Operations) Peek(ctx context.Context, req transport.PeekRequest) (transport.PeekResult, error) {
	res := transport.PeekResult{Total: -1}
	if err := req.Validate(); err != nil {
		return res, err
	}
	if req.From != "" && req.From != transport.ConsumerDLQ {
		return res, fmt.Errorf("peek: %s: %w", req.From, transport.ErrNoSuchDLQ)
	}
	if req.Limit < 1 {
		return res, errors.New("peek: limit must be at least 1")
	}
	c, err := o.consumer(req.Consumer)
	if err != nil {
		return res, fmt.Errorf("peek: %w", err)
	}
	seen := int64(0)
	full := false
	err = o.deadLetters(ctx, c, func(_ jetstream.Stream, m *jetstream.RawStreamMsg) (bool, error) {
		seen++
		if d := describeMsg(m, req.Bodies); req.Matches(d) {
			res.Messages = append(res.Messages, d)
		}
		full = len(res.Messages) >= req.Limit
		return full, nil
	})
	if err != nil {
		return res, fmt.Errorf("peek: %w", err)
	}
	res.Total = seen
	if d, derr := o.Depths(ctx, req.Consumer); derr == nil && len(d) == 1 && d[0].DLQ >= 0 {
		res.Total = d[0].DLQ
	}
	res.Complete = !full || seen >= res.Total
	return res, nil
}

// Discard deletes the selected dead letters from the dead-letter stream
// (transport.Operations.Discard); the others stay, in order.
func (o *Operations) Discard(ctx context.Context, req transport.DiscardRequest) (transport.DiscardResult, error) {
	var res transport.DiscardResult
	if err := req.Validate(); err != nil {
		return res, err
	}
	if req.From != "" && req.From != transport.ConsumerDLQ {
		return res, fmt.Errorf("discard: %s: %w", req.From, transport.ErrNoSuchDLQ)
	}
	if req.All() {
		return res, errors.New("discard: select messages by group or key")
	}
	if req.Max < 1 {
		return res, errors.New("discard: max must be at least 1")
	}
	c, err := o.consumer(req.Consumer)
	if err != nil {
		return res, fmt.Errorf("discard: %w", err)
	}
	found := map[string]bool{}
	seen := int64(0)
	err = o.deadLetters(ctx, c, func(dlq jetstream.Stream, m *jetstream.RawStreamMsg) (bool, error) {
		seen++
		if req.Progress != nil {
			req.Progress(seen, -1)
		}
		d := describeMsg(m, false)
		if !req.Matches(d) {
			return false, nil
		}
		if !req.DryRun {
			if err := dlq.DeleteMsg(ctx, m.Sequence); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
				return true, fmt.Errorf("delete dead letter %d: %w", m.Sequence, err)
			}
		}
		res.Discarded = append(res.Discarded, d)
		found[d.Key], found[d.ID] = true, true
		return len(res.Discarded) >= req.Max, nil
	})
	for _, k := range req.Keys {
		if !found[k] {
			res.Missing = append(res.Missing, k)
		}
	}
	res.Complete = err == nil
	if err != nil {
		return res, fmt.Errorf("discard: %w", err)
	}
	return res, nil
}

// redriven strips the dead-letter diagnostics from h and counts the redrive.
func (t *Topology) redriven(h *natsgo.Header) {
	if *h == nil {
		*h = natsgo.Header{}
	}
	n, _ := strconv.Atoi(h.Get(HeaderRedriven))
	for k := range *h {
		switch {
		case strings.HasPrefix(strings.ToLower(k), "nats-"),
			k == HeaderErrorClass, k == HeaderErrorReason, k == HeaderConsumer, k == HeaderDeadAt,
			k == HeaderDeliveries, k == HeaderSubject, k == HeaderStreamSeq:
			delete(*h, k)
		}
	}
	(*h)[HeaderRedriven] = []string{strconv.Itoa(n + 1)}
}

// Replay publishes msgs to the consumer's replay subject only, in the order
// given, with the usual headers. Each Replay call uses fresh message ids
// (the events' own ids would be dropped as duplicates inside the window).
// Messages go out in acknowledged batches of up to 100 with at most one
// message per aggregate in flight, so an aggregate's next event is
// published only after the previous one was stored; Replay stops at the
// first failure and returns how many were stored.
func (o *Operations) Replay(ctx context.Context, consumer string, msgs []outbox.Message) (int, error) {
	c, err := o.consumer(consumer)
	if err != nil {
		return 0, fmt.Errorf("replay: %w", err)
	}
	t := &o.cfg.Topology
	run := uuid.NewString()
	sent := 0
	for start := 0; start < len(msgs); start += redriveBatch {
		chunk := msgs[start:min(start+redriveBatch, len(msgs))]
		idx := make([]int, len(chunk))
		for i := range chunk {
			idx[i] = i
		}
		for _, wave := range waves(chunk, idx) {
			out := make([]outgoing, len(wave))
			for k, i := range wave {
				m := &chunk[i]
				subject := t.ReplaySubjectPrefix(c) + "." + t.subject.Render(m, SanitizeToken)
				o, err := t.outgoing(m, subject, "replay:"+run+":"+m.EventID)
				if err != nil {
					return sent, fmt.Errorf("replay: event %s: %w", m.EventID, err)
				}
				out[k] = o
			}
			var failed error
			for k, err := range o.out.send(ctx, out) {
				if err == nil {
					sent++
				} else if failed == nil {
					failed = fmt.Errorf("replay to %s: event %s: %w", c.Name, chunk[wave[k]].EventID, err)
				}
			}
			if failed != nil {
				return sent, failed
			}
		}
	}
	return sent, nil
}

// Selects reports whether the consumer's filters select m: replay sends a
// consumer only the events it would have received.
func (o *Operations) Selects(consumer string, m outbox.Message) (bool, error) {
	c, err := o.consumer(consumer)
	if err != nil {
		return false, err
	}
	return o.cfg.Topology.Selects(c, o.cfg.Topology.EventSubject(&m)), nil
}
