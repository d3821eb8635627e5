// Package outboxtest provides an in-memory outbox.Publisher for tests and
// benchmarks: it records what was acknowledged, in order, and can inject
// failures.
package outboxtest

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"

	"github.com/fifobox/fifobox/pkg/outbox"
)

// ErrInjected is the retryable failure the Recorder injects.
var ErrInjected = errors.New("outboxtest: injected publish failure")

// Ack is one acknowledged message.
type Ack struct {
	EventID       string
	AggregateType string
	AggregateID   string
	Sequence      int64
}

// Recorder is a Publisher that acknowledges messages and remembers them in
// acknowledgement order. It is safe for concurrent use.
type Recorder struct {
	// FailRate is the probability (0-1) that a whole Publish call fails
	// (every message gets ErrInjected).
	FailRate float64
	// EntryFailRate is the probability that a single message fails.
	EntryFailRate float64
	// Fail, if set, decides per message: a non-nil error is returned for it.
	Fail func(outbox.Message) error

	mu   sync.Mutex
	acks []Ack
}

// Publish implements outbox.Publisher.
func (r *Recorder) Publish(ctx context.Context, msgs []outbox.Message) []error {
	errs := make([]error, len(msgs))
	if r.FailRate > 0 && rand.Float64() < r.FailRate {
		for i := range errs {
			errs[i] = ErrInjected
		}
		return errs
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, m := range msgs {
		if r.Fail != nil {
			if err := r.Fail(m); err != nil {
				errs[i] = err
				continue
			}
		}
		if r.EntryFailRate > 0 && rand.Float64() < r.EntryFailRate {
			errs[i] = ErrInjected
			continue
		}
		r.acks = append(r.acks, Ack{EventID: m.EventID, AggregateType: m.AggregateType, AggregateID: m.GroupID, Sequence: m.Sequence})
	}
	return errs
}

// Acks returns a copy of the acknowledgements so far, in order.
func (r *Recorder) Acks() []Ack {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Ack(nil), r.acks...)
}

// Len returns the number of acknowledgements so far.
func (r *Recorder) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.acks)
}
