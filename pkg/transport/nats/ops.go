package nats

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/google/uuid"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/outbox"
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
	for _, name := range names {
		if _, err := o.consumer(name); err != nil {
			return nil, fmt.Errorf("queue depths: %w", err)
		}
	}
	_, js, err := o.out.conn.get(ctx, o.cfg.ConnectWait)
	if err != nil {
		return nil, fmt.Errorf("queue depths: %w", err)
	}
	t := &o.cfg.Topology
	var dlqCounts map[string]uint64
	var dlqErr error
	if dlq, err := js.Stream(ctx, t.DeadLetterStream); err != nil {
		dlqErr = err
	} else if info, err := dlq.Info(ctx, jetstream.WithSubjectFilter(t.dlqPrefix()+".>")); err != nil {
		dlqErr = err
	} else {
		dlqCounts = info.State.Subjects
	}
	var out []transport.QueueDepth
	for _, name := range names {
		c, _ := o.consumer(name)
		d := transport.QueueDepth{Consumer: c.Name, Queue: t.Stream + "/" + c.Durable()}
		var errs []string
		if ci, err := js.Consumer(ctx, t.Stream, c.Durable()); err != nil {
			errs = append(errs, fmt.Sprintf("consumer %s: %v", c.Durable(), err))
			d.Ready, d.InFlight, d.Retrying = -1, -1, -1
		} else if info, err := ci.Info(ctx); err != nil {
			errs = append(errs, fmt.Sprintf("consumer %s: %v", c.Durable(), err))
			d.Ready, d.InFlight, d.Retrying = -1, -1, -1
		} else {
			d.Ready, d.InFlight, d.Retrying, d.Consumers = int64(info.NumPending), int64(info.NumAckPending), int64(info.NumRedelivered), info.NumWaiting
		}
		if dlqErr != nil {
			errs = append(errs, fmt.Sprintf("dead-letter stream %s: %v", t.DeadLetterStream, dlqErr))
			d.DLQ = -1
		} else {
			d.DLQ = int64(dlqCounts[t.DLQSubject(c)])
		}
		d.Error = strings.Join(errs, "; ")
		out = append(out, d)
	}
	return out, nil
}

// Redrive is transport.Operations.Redrive: the consumer's DLQ (the only
// dead-letter queue this transport has) through redrive, or in a dry run
// its depth.
func (o *Operations) Redrive(ctx context.Context, req transport.RedriveRequest) (transport.RedriveResult, error) {
	res := transport.RedriveResult{Waiting: -1, InFlight: -1}
	if req.From != "" && req.From != transport.ConsumerDLQ {
		return res, fmt.Errorf("redrive: %s: %w", req.From, transport.ErrNoSuchDLQ)
	}
	if req.DryRun {
		d, err := o.Depths(ctx, req.Consumer)
		if err != nil {
			return res, fmt.Errorf("redrive: %w", err)
		}
		if len(d) != 1 || d[0].DLQ < 0 {
			return res, fmt.Errorf("redrive: the DLQ depth of %s is unknown: %v", req.Consumer, d)
		}
		res.Waiting = d[0].DLQ
		res.Moved = int(min(d[0].DLQ, int64(req.Max)))
		return res, nil
	}
	n, err := o.redrive(ctx, req.Consumer, req.Max, req.Progress)
	res.Moved = n
	return res, err
}

// redrive moves up to max messages from the consumer's dead letters back to
// it, in the order they died: it reads them in dead-letter stream order,
// publishes each to the consumer's replay subject (which only its filters
// select) and waits for the PubAck, then deletes it from the dead-letter
// stream. A redriven message is a new stream message, so its delivery count,
// and with it the retry budget, starts afresh; it loses the Fifobox-Error-*
// diagnostics and gets Fifobox-Redriven incremented. Its Nats-Msg-Id is
// derived from its dead-letter sequence, so a redrive that crashed between
// publishing and deleting re-publishes into the duplicate window and is
// dropped; after the window the inbox drops the copy.
func (o *Operations) redrive(ctx context.Context, consumer string, max int, progress func(moved, total int64)) (int, error) {
	c, err := o.consumer(consumer)
	if err != nil {
		return 0, fmt.Errorf("redrive: %w", err)
	}
	if max < 1 {
		return 0, errors.New("redrive: max must be at least 1")
	}
	_, js, err := o.out.conn.get(ctx, o.cfg.ConnectWait)
	if err != nil {
		return 0, fmt.Errorf("redrive: %w", err)
	}
	t := &o.cfg.Topology
	dlq, err := js.Stream(ctx, t.DeadLetterStream)
	if err != nil {
		return 0, fmt.Errorf("redrive: dead-letter stream %s: %w", t.DeadLetterStream, err)
	}
	subject := t.DLQSubject(c)
	moved := 0
	var next uint64 = 1
	for moved < max {
		if err := ctx.Err(); err != nil {
			return moved, fmt.Errorf("redrive: stopped after %d messages: %w", moved, err)
		}
		// The next dead letter of this consumer at or after next, by sequence.
		m, err := dlq.GetMsg(ctx, next, jetstream.WithGetMsgSubject(subject))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return moved, nil
		}
		if err != nil {
			return moved, fmt.Errorf("redrive: read %s after sequence %d: %w", subject, next, err)
		}
		o.cfg.Topology.redriven(&m.Header)
		rest := strings.TrimPrefix(m.Header.Get(HeaderSubject), t.SubjectPrefix+".")
		if rest == "" || rest == m.Header.Get(HeaderSubject) {
			rest = "redriven"
		}
		msg := &natsgo.Msg{Subject: t.ReplaySubjectPrefix(c) + "." + rest, Data: m.Data, Header: m.Header}
		msg.Header[HeaderMsgID] = []string{fmt.Sprintf("redrive:%s:%s:%d", c.Name, t.DeadLetterStream, m.Sequence)}
		if err := o.out.sendOne(ctx, outgoing{msg: msg, stream: t.Stream}); err != nil {
			return moved, fmt.Errorf("redrive: send dead letter %d to %s (it stays dead): %w", m.Sequence, msg.Subject, err)
		}
		if err := dlq.DeleteMsg(ctx, m.Sequence); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
			return moved, fmt.Errorf("redrive: delete dead letter %d (it was re-sent; the inbox drops copies): %w", m.Sequence, err)
		}
		moved++
		next = m.Sequence + 1
		if moved%redriveBatch == 0 {
			o.cfg.Logger.Info("nats redrive: progress", "consumer", c.Name, "moved", moved)
			if progress != nil {
				progress(int64(moved), -1)
			}
		}
	}
	return moved, nil
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
				subject := t.ReplaySubjectPrefix(c) + "." + t.subject.render(m, SanitizeToken)
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
