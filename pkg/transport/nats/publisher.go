package nats

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Publish outcomes. ErrTooLarge, ErrWrongStream, ErrSubjectNotBound and
// ErrSubject are permanent (wrapped in envelope.Permanent); every other is
// retryable: retrying is safe (Nats-Msg-Id deduplicates inside the window,
// the inbox after it), while marking an event dead parks its aggregate
// until an operator acts.
var (
	// ErrNoAck: no PubAck arrived in time, or the connection dropped before
	// it did. Retryable: the message may or may not be stored; a republish
	// inside the duplicate window is acknowledged as a duplicate.
	ErrNoAck = errors.New("nats: no PubAck: the message may or may not be stored")
	// ErrNoStream: nothing answered on the subject and the stream does not
	// exist (not provisioned yet, or deleted) or could not be looked up.
	// Retryable: provisioning repairs it.
	ErrNoStream = errors.New("nats: no stream answered for the subject")
	// ErrRefused: the stream answered with an error other than the
	// permanent ones (full, insufficient resources, no leader). Retryable.
	ErrRefused = errors.New("nats: the stream refused the message")
	// ErrTooLarge (permanent): bigger than the stream's max_msg_size or the
	// server's max_payload.
	ErrTooLarge = errors.New("nats: message too large")
	// ErrWrongStream (permanent): the subject is bound to another stream
	// than the topology's (Nats-Expected-Stream did not match).
	ErrWrongStream = errors.New("nats: the subject is bound to another stream")
	// ErrSubjectNotBound (permanent): the topology's stream exists but none
	// of its subjects covers the message's subject, although a consumer's
	// filters select it (for an event no consumer selects, the topology's
	// Unrouted policy decides instead: delivered and reported by default).
	ErrSubjectNotBound = errors.New("nats: the subject is not bound to the stream")
	// ErrSubject (permanent): the rendered subject is not a valid subject.
	ErrSubject = errors.New("nats: invalid subject")
	// ErrPredecessorFailed (retryable): an earlier message of the same
	// aggregate in the same Publish call was not published, so this one was
	// not sent (it would overtake it).
	ErrPredecessorFailed = errors.New("nats: an earlier message of the same aggregate was not published")
)

// JetStream API error codes the publisher maps.
const (
	codeMsgTooLarge     jetstream.ErrorCode = 10054 // message size exceeds maximum allowed
	codeStreamMismatch  jetstream.ErrorCode = 10060 // expected stream does not match
	codeStreamNotMatch2 jetstream.ErrorCode = 10056 // expected stream (older servers)
)

// Publisher is the outbox.Publisher for a JetStream stream: one message per
// event on the subject the topology's template renders, Nats-Msg-Id = event
// id, fifobox headers, and a PubAck awaited for every message before its
// result is nil.
//
// Each Publish call publishes its messages asynchronously and then waits
// for all their PubAcks (one round trip per call, not per message). The
// dispatcher never passes two messages of one aggregate; if it did, the
// second would go only after the first was acknowledged.
type Publisher struct {
	cfg  Config
	topo *Topology
	s    *sender
}

var _ outbox.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher. It does not connect until the first Publish.
func NewPublisher(cfg Config) (*Publisher, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new nats publisher: %w", err)
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
	unrouted := make([]bool, len(msgs))
	var ready []int
	for i := range msgs {
		var err error
		if p.cfg.Wire != nil {
			// A wire profile's stream captures its subjects, for consumers
			// fifobox does not know: an event on a subject the stream does not
			// capture is the unrouted one.
			if out[i], err = p.wireOutgoing(&msgs[i]); err != nil {
				errs[i] = err
				continue
			}
			unrouted[i] = !p.wireCaptures(out[i].msg.Subject)
			ready = append(ready, i)
			continue
		}
		subject := p.topo.EventSubject(&msgs[i])
		unrouted[i] = !p.topo.selectedByAny(subject)
		alternate := unrouted[i] && p.topo.Unrouted.Policy == transport.UnroutedAlternate
		if alternate {
			subject = p.topo.UnroutedSubject(&msgs[i])
		}
		if out[i], err = p.topo.outgoing(&msgs[i], subject, msgs[i].EventID); err != nil {
			errs[i] = err
			continue
		}
		if alternate {
			out[i].stream = p.topo.DeadLetterStream
		}
		ready = append(ready, i)
	}
	type aggKey struct{ typ, id string }
	failed := map[aggKey]bool{}
	for _, wave := range waves(msgs, ready) {
		var send []outgoing
		var idx []int
		for _, i := range wave {
			if failed[aggKey{msgs[i].AggregateType, msgs[i].GroupID}] {
				errs[i] = ErrPredecessorFailed
				continue
			}
			send, idx = append(send, out[i]), append(idx, i)
		}
		for k, err := range p.s.send(ctx, send) {
			i := idx[k]
			if unrouted[i] {
				err = p.unroutedPolicy(&msgs[i], send[k].msg.Subject, err)
			}
			if errs[i] = err; err != nil {
				failed[aggKey{msgs[i].AggregateType, msgs[i].GroupID}] = true
			}
		}
	}
	return errs
}

// unroutedPolicy reports an event no consumer selects, published on
// subject with result err; under the deliver policy a subject the stream
// does not capture counts as delivered too. Any other failure stands.
func (p *Publisher) unroutedPolicy(m *outbox.Message, subject string, err error) error {
	pol := p.topo.Unrouted.Policy
	switch {
	case err == nil:
		to := "stream " + p.topo.Stream + " (no consumer selects it)"
		if pol == transport.UnroutedAlternate {
			to = "stream " + p.topo.DeadLetterStream + " subject " + subject
		}
		p.s.unrouted.Add(1)
		transport.LogUnrouted(p.cfg.Logger, transport.NATS, pol, m, to)
	case pol == transport.UnroutedDeliver && errors.Is(err, ErrSubjectNotBound):
		p.s.unrouted.Add(1)
		transport.LogUnrouted(p.cfg.Logger, transport.NATS, pol, m, "nowhere (no stream captures "+subject+")")
		return nil
	}
	return err
}

// outgoing renders m as a message on subject for the events stream, with
// the fifobox headers and msgID as Nats-Msg-Id.
func (t *Topology) outgoing(m *outbox.Message, subject, msgID string) (outgoing, error) {
	if !validSubject(subject) {
		return outgoing{}, envelope.Permanent(fmt.Errorf("%w: %q", ErrSubject, subject))
	}
	msg := &natsgo.Msg{Subject: subject, Data: m.Body, Header: t.headersFor(m)}
	msg.Header[HeaderMsgID] = []string{msgID}
	if n := msgSize(msg); n > int(t.MaxMsgSize) {
		return outgoing{}, envelope.Permanent(fmt.Errorf("%w: %d bytes, stream limit %d", ErrTooLarge, n, t.MaxMsgSize))
	}
	return outgoing{msg: msg, stream: t.Stream}, nil
}

// headersFor is the fifobox headers and the topology's extra headers for m.
// Keys are set directly (not through Header.Set) so "traceparent" keeps the
// W3C spelling.
func (t *Topology) headersFor(m *outbox.Message) natsgo.Header {
	h := make(natsgo.Header, 10+len(t.headers))
	set := func(k, v string) {
		if v != "" {
			h[k] = []string{headerValue(v)}
		}
	}
	set(HeaderEventID, m.EventID)
	set(HeaderEventType, m.EventType)
	set(HeaderAggregateType, m.AggregateType)
	set(HeaderAggregateID, m.GroupID)
	if m.Sequence > 0 {
		set(HeaderSequence, strconv.FormatInt(m.Sequence, 10))
	}
	set(HeaderTenantID, m.Attributes[envelope.AttrTenantID])
	set(HeaderTraceparent, m.Attributes[envelope.AttrTraceparent])
	set(HeaderContentType, "application/json")
	for name, tpl := range t.headers {
		v := tpl.Render(m, nil)
		if v == "" && tpl.Single() {
			continue
		}
		h[name] = []string{headerValue(v)}
	}
	return h
}

// msgSize approximates the stored size: subject, headers and body.
func msgSize(m *natsgo.Msg) int {
	n := len(m.Subject) + len(m.Data) + 12
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
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

// outgoing is one message to publish, with the stream expected to store it.
type outgoing struct {
	msg    *natsgo.Msg
	stream string
}

// sender publishes to JetStream and waits for PubAcks, over one connection
// kept open by a connector. The Publisher, the runners' dead-letter sends,
// redrive and replay all use one.
type sender struct {
	cfg  *Config
	conn *connector

	mu      sync.Mutex
	streams map[string]streamCheck // cached lookups for mapping "no responders"

	stored, duplicates, unrouted atomic.Int64
}

// PublishStats counts a publisher's acknowledged messages.
type PublishStats struct {
	// Stored counts messages the stream stored.
	Stored int64
	// Duplicates counts republished messages the stream acknowledged as
	// duplicates inside its duplicate window (PubAck.Duplicate) and did not
	// store again: each is a dispatcher retry after a lost acknowledgement.
	Duplicates int64
	// Unrouted counts events no consumer of the topology selects, handled
	// by the topology's Unrouted policy (each also logged as
	// transport.UnroutedLogMessage).
	Unrouted int64
}

// Stats returns the publisher's counts since it was created.
func (p *Publisher) Stats() PublishStats {
	return PublishStats{Stored: p.s.stored.Load(), Duplicates: p.s.duplicates.Load(), Unrouted: p.s.unrouted.Load()}
}

type streamCheck struct {
	subjects []string
	missing  bool
	at       time.Time
}

func newSender(cfg *Config, role string) *sender {
	return &sender{cfg: cfg, conn: newConnector(cfg, role), streams: map[string]streamCheck{}}
}

func (s *sender) close() error { return s.conn.close() }

// send publishes out without waiting, then waits for every PubAck; errs[i]
// is out[i]'s result (nil: stored, or a duplicate of a stored message).
func (s *sender) send(ctx context.Context, out []outgoing) []error {
	errs := make([]error, len(out))
	if len(out) == 0 {
		return errs
	}
	_, js, err := s.conn.get(ctx, s.cfg.ConnectWait)
	if err != nil {
		for i := range errs {
			errs[i] = fmt.Errorf("nats publish: %w", err)
		}
		return errs
	}
	futs := make([]jetstream.PubAckFuture, len(out))
	for i, o := range out {
		f, err := js.PublishMsgAsync(o.msg, jetstream.WithExpectStream(o.stream))
		if err != nil {
			errs[i] = s.classify(ctx, js, o, err)
			continue
		}
		futs[i] = f
	}
	timer := time.NewTimer(s.cfg.AckTimeout)
	defer timer.Stop()
	for i, f := range futs {
		if f == nil {
			continue
		}
		select {
		case ack := <-f.Ok():
			switch {
			case ack.Stream != out[i].stream:
				errs[i] = envelope.Permanent(fmt.Errorf("%w: stored in %q, want %q", ErrWrongStream, ack.Stream, out[i].stream))
			case ack.Duplicate:
				s.duplicates.Add(1)
			default:
				s.stored.Add(1)
			}
		case err := <-f.Err():
			errs[i] = s.classify(ctx, js, out[i], err)
		case <-ctx.Done():
			errs[i] = fmt.Errorf("%w: subject %s: %v", ErrNoAck, out[i].msg.Subject, ctx.Err())
		case <-timer.C:
			errs[i] = fmt.Errorf("%w: subject %s: no PubAck within %s", ErrNoAck, out[i].msg.Subject, s.cfg.AckTimeout)
			timer.Reset(0) // the rest are as late
		}
	}
	return errs
}

// sendOne is send for one message.
func (s *sender) sendOne(ctx context.Context, o outgoing) error { return s.send(ctx, []outgoing{o})[0] }

// classify maps a publish error to a documented outcome.
func (s *sender) classify(ctx context.Context, js jetstream.JetStream, o outgoing, err error) error {
	subj := o.msg.Subject
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, natsgo.ErrMaxPayload):
		return envelope.Permanent(fmt.Errorf("%w: subject %s: %v", ErrTooLarge, subj, err))
	case errors.As(err, &apiErr) && apiErr.ErrorCode == codeMsgTooLarge:
		return envelope.Permanent(fmt.Errorf("%w: subject %s: %v", ErrTooLarge, subj, err))
	case errors.As(err, &apiErr) && (apiErr.ErrorCode == codeStreamMismatch || apiErr.ErrorCode == codeStreamNotMatch2):
		return envelope.Permanent(fmt.Errorf("%w: subject %s, want stream %s: %v", ErrWrongStream, subj, o.stream, err))
	case errors.Is(err, natsgo.ErrBadSubject):
		return envelope.Permanent(fmt.Errorf("%w: %q: %v", ErrSubject, subj, err))
	case errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, natsgo.ErrNoResponders):
		return s.noResponders(ctx, js, o, err)
	case errors.As(err, &apiErr):
		return fmt.Errorf("%w: subject %s: %v", ErrRefused, subj, err)
	}
	// Timeouts, a dropped or closed connection, a context that ended.
	return fmt.Errorf("%w: subject %s: %v", ErrNoAck, subj, err)
}

// noResponders tells a stream that is missing or between leaders
// (retryable) from one that exists without the subject (permanent: the
// topology and the stream disagree, and no retry changes that).
func (s *sender) noResponders(ctx context.Context, js jetstream.JetStream, o outgoing, cause error) error {
	subj := o.msg.Subject
	s.mu.Lock()
	c, ok := s.streams[o.stream]
	s.mu.Unlock()
	if !ok || time.Since(c.at) > 2*time.Second {
		lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		st, err := js.Stream(lctx, o.stream)
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound):
			c = streamCheck{missing: true, at: time.Now()}
		case err != nil:
			return fmt.Errorf("%w: subject %s (stream %s could not be looked up: %v): %v", ErrNoStream, subj, o.stream, err, cause)
		default:
			c = streamCheck{subjects: st.CachedInfo().Config.Subjects, at: time.Now()}
		}
		s.mu.Lock()
		s.streams[o.stream] = c
		s.mu.Unlock()
	}
	if c.missing {
		return fmt.Errorf("%w: subject %s: stream %s does not exist (provision the topology): %v", ErrNoStream, subj, o.stream, cause)
	}
	for _, pat := range c.subjects {
		if SubjectMatches(pat, subj) {
			// Bound, yet nobody answered: a leader election or a restart.
			return fmt.Errorf("%w: subject %s: stream %s did not answer: %v", ErrNoAck, subj, o.stream, cause)
		}
	}
	return envelope.Permanent(fmt.Errorf("%w: subject %s, stream %s has subjects %v", ErrSubjectNotBound, subj, o.stream, c.subjects))
}
