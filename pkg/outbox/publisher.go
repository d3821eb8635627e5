package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Message is one claimed outbox row, ready to publish.
type Message struct {
	// ID is the outbox row id.
	ID int64
	// EventID is the envelope id; publishers use it as the broker's deduplication
	// id (SNS MessageDeduplicationId, JetStream Nats-Msg-Id, AMQP message-id).
	EventID string
	// GroupID is the aggregate id; publishers use it as the SNS message group id.
	GroupID string
	// AggregateType, Sequence and EventType identify the event for logs and tests.
	AggregateType string
	Sequence      int64
	EventType     string
	// Body is the encoded envelope, published as the message body.
	Body []byte
	// Attributes are the message attributes (see envelope.Attributes).
	Attributes map[string]string
	// Attempt counts publish attempts including this one (1 on the first).
	Attempt int
}

// Publisher sends messages to the broker.
//
// Publish receives at most the dispatcher's PublishBatchSize messages, never
// two of the same aggregate, and returns exactly one error per message, in
// the same order: nil when the broker acknowledged it, an envelope.Permanent error when
// retrying cannot help (the event goes dead), any other error to retry later
// with backoff. A result slice of the wrong length counts as a retryable
// failure of every message.
type Publisher interface {
	Publish(ctx context.Context, msgs []Message) []error
}

// PublisherFunc adapts a function to Publisher.
type PublisherFunc func(ctx context.Context, msgs []Message) []error

// Publish calls f.
func (f PublisherFunc) Publish(ctx context.Context, msgs []Message) []error { return f(ctx, msgs) }

// ErrDuplicateEvent is returned by Enqueue when an event id already exists.
var ErrDuplicateEvent = errors.New("outbox: event id already enqueued")

// errWrongResultCount is used when a Publisher breaks its contract.
func errWrongResultCount(got, want int) error {
	return fmt.Errorf("publisher returned %d results for %d messages", got, want)
}

func attributes(eventType, aggregateType, tenant, traceparent string) map[string]string {
	// Same attributes as envelope.Envelope.Attributes, built from columns so
	// the claim need not decode the body.
	e := envelope.Envelope{Type: eventType, AggregateType: aggregateType, TenantID: tenant, TraceParent: traceparent}
	return e.Attributes()
}
