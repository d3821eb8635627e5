package transport

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
)

// Verdict is what a transport does with a delivered message once Process
// has run it.
type Verdict int

const (
	// Ack: applied now or before (a duplicate); settle the message.
	Ack Verdict = iota + 1
	// Retry: a transient failure; deliver it again after the retry policy's
	// delay, or dead-letter it when its retries are used up.
	Retry
	// DeadLetter: invalid, or failed permanently; send it to the dead-letter
	// queue now, with Result.Class and Result.Err as the reason.
	DeadLetter
)

func (v Verdict) String() string {
	switch v {
	case Ack:
		return "ack"
	case Retry:
		return "retry"
	case DeadLetter:
		return "dead-letter"
	}
	return "unknown"
}

// Result is one message's outcome.
type Result struct {
	Verdict Verdict
	// Outcome is inbox.Applied or inbox.Duplicate when Verdict is Ack.
	Outcome inbox.Outcome
	// Class is inbox.ClassTransient, ClassPermanent or ClassInvalid when
	// Verdict is not Ack.
	Class string
	// Err is the failure (never contains the payload).
	Err error
	// Envelope is the decoded event; zero when the body is invalid.
	Envelope envelope.Envelope
}

// Process decodes one delivered message body and applies it once for
// consumer through inbox.Process, and says what the transport should do
// with the message. It is the broker-neutral half of every consumer: the
// transport supplies the body and settles the message by the verdict.
// A panicking side effect is a transient failure, not a crash.
func Process(ctx context.Context, db inbox.DB, consumer string, body []byte, apply inbox.Apply) Result {
	e, err := envelope.Decode(body)
	if err != nil {
		return Result{Verdict: DeadLetter, Class: inbox.ClassInvalid, Err: err}
	}
	return ProcessEnvelope(ctx, db, consumer, e, apply)
}

// ProcessEnvelope is Process for an envelope the transport decoded already
// (to route it by aggregate before applying it).
func ProcessEnvelope(ctx context.Context, db inbox.DB, consumer string, e envelope.Envelope, apply inbox.Apply) Result {
	ctx = e.ContextWithTrace(ctx)
	out, err := func() (out inbox.Outcome, err error) {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("side effect panicked: %v", p)
			}
		}()
		return inbox.Process(ctx, db, consumer, e, func(ctx context.Context, tx pgx.Tx) error { return apply(ctx, tx, e) })
	}()
	return verdict(e, out, err)
}

// ProcessInBatch is ProcessEnvelope inside b, a transaction shared with
// other messages (inbox.Batch): an Ack verdict holds only once b commits,
// and the transport must not settle the message before that.
func ProcessInBatch(ctx context.Context, b *inbox.Batch, e envelope.Envelope, apply inbox.Apply) Result {
	ctx = e.ContextWithTrace(ctx)
	out, err := b.Apply(ctx, e, func(ctx context.Context, tx pgx.Tx) error { return apply(ctx, tx, e) })
	return verdict(e, out, err)
}

func verdict(e envelope.Envelope, out inbox.Outcome, err error) (res Result) {
	res.Envelope = e
	switch {
	case err == nil:
		res.Verdict, res.Outcome = Ack, out
	case envelope.IsPermanent(err):
		res.Verdict, res.Class, res.Err = DeadLetter, inbox.ClassPermanent, err
	default:
		res.Verdict, res.Class, res.Err = Retry, inbox.ClassTransient, err
	}
	return res
}
