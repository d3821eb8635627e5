package transport

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Kind names a transport.
type Kind string

// The transports fifobox knows.
const (
	SNS      Kind = "sns"      // SNS FIFO topic, SQS FIFO queues (the default)
	RabbitMQ Kind = "rabbitmq" // RabbitMQ or Amazon MQ for RabbitMQ (pkg/transport/amqp)
	NATS     Kind = "nats"     // NATS JetStream
)

// EnvTransport is the environment variable that chooses the transport.
const EnvTransport = "FIFOBOX_TRANSPORT"

// ParseKind returns the Kind named by s; "" means SNS.
func ParseKind(s string) (Kind, error) {
	switch k := Kind(strings.ToLower(strings.TrimSpace(s))); k {
	case "":
		return SNS, nil
	case SNS, RabbitMQ, NATS:
		return k, nil
	}
	return "", fmt.Errorf("transport %q: must be sns, rabbitmq or nats", s)
}

// Env declares the variable KindFromEnv reads (pkg/envspec: the Lambdas'
// runtime contract tests check every read against the CDK templates).
var Env = envspec.Set{
	{Name: EnvTransport, Doc: "sns (default), rabbitmq or nats"},
}

// KindFromEnv reads FIFOBOX_TRANSPORT (default sns).
func KindFromEnv() (Kind, error) {
	k, err := ParseKind(Env.Get(EnvTransport))
	if err != nil {
		return "", fmt.Errorf("%s: %w", EnvTransport, err)
	}
	return k, nil
}

// Publisher is what the dispatcher publishes through. It is outbox.Publisher
// itself, named here so each transport's four parts read together; see its
// contract there (per-message results: nil once the broker acknowledged,
// envelope.Permanent when no retry can help, any other error to retry).
type Publisher = outbox.Publisher

// Provisioner creates a transport's topology (exchanges, topics, streams,
// queues, bindings, dead-letter and retry queues) from its definition as
// data. Provision is idempotent: running it again against a broker that
// already has the topology changes nothing, and it reports an existing
// entity whose settings differ from the definition instead of silently
// keeping or replacing it.
type Provisioner interface {
	Provision(ctx context.Context) error
}

// Runner consumes one consumer's messages and applies them through the
// inbox until ctx is done, reconnecting on its own after broker outages.
// It returns nil when ctx ends, or an error that retrying cannot fix
// (configuration).
type Runner interface {
	Run(ctx context.Context) error
}

// QueueDepth is one consumer's queue figures, for `fifobox status` and alarms.
// A figure the broker cannot report is -1.
type QueueDepth struct {
	// Consumer is the consumer's name (its inbox key).
	Consumer string `json:"consumer"`
	// Queue is the broker's name for the consumer's queue, stream consumer or subscription.
	Queue string `json:"queue"`
	// Ready counts messages waiting to be delivered.
	Ready int64 `json:"ready"`
	// InFlight counts messages delivered and not yet settled.
	InFlight int64 `json:"in_flight"`
	// Retrying counts messages waiting out a retry delay.
	Retrying int64 `json:"retrying"`
	// DLQ counts dead messages.
	DLQ int64 `json:"dlq"`
	// DLQInFlight counts dead messages received from the DLQ and not yet
	// deleted (SQS: a redrive or a look at the DLQ in progress).
	DLQInFlight int64 `json:"dlq_in_flight"`
	// SubscriptionDLQ counts messages the broker could not deliver to the
	// consumer's queue (SNS subscriptions' DLQs; 0 where there is none).
	SubscriptionDLQ int64 `json:"subscription_dlq"`
	// Consumers counts attached consumers (for single-active-consumer
	// queues, one is active and the rest are standing by).
	Consumers int `json:"consumers"`
	// QueueState, DLQState and SubscriptionDLQState say whether each
	// queue's figures could be read; a figure that could not is -1.
	QueueState           QueueState `json:"queue_state"`
	DLQState             QueueState `json:"dlq_state"`
	SubscriptionDLQState QueueState `json:"subscription_dlq_state"`
	// Error says why the figures are missing or partial, in full.
	Error string `json:"error,omitempty"`
}

// DLQ names one of a consumer's dead-letter queues.
type DLQ string

const (
	// ConsumerDLQ is the dead-letter queue of the consumer's queue: what the
	// consumer could not apply. Every transport has it.
	ConsumerDLQ DLQ = "dlq"
	// SubscriptionDLQ holds what the broker could not deliver to the
	// consumer's queue at all (an SNS subscription's DLQ: a disabled KMS
	// key, a changed queue policy). Only SNS has it.
	SubscriptionDLQ DLQ = "subscription-dlq"
)

// ErrNoSuchDLQ is returned (wrapped) by Redrive for a dead-letter queue the
// transport does not have.
var ErrNoSuchDLQ = errors.New("the transport has no such dead-letter queue")

// RedriveRequest is what Operations.Redrive moves.
type RedriveRequest struct {
	// Consumer names the consumer. Required.
	Consumer string
	// From is the dead-letter queue to move from; "" is ConsumerDLQ.
	From DLQ
	// Max bounds how many messages move (at least 1).
	Max int
	// Groups and Aggregates, if set, move only these message groups
	// (aggregate ids) and aggregates ("type/id" or an id; see
	// DLQSelection); the other messages stay where they are, in order.
	Groups     []string
	Aggregates []string
	// DryRun counts what would move and moves nothing.
	DryRun bool
	// Progress, if set, is called as messages move: moved so far of total
	// (-1 if unknown).
	Progress func(moved, total int64)
}

// RedriveResult is what a redrive moved (or, in a dry run, would move).
type RedriveResult struct {
	// Moved counts messages moved back to the consumer's queue (in a dry
	// run: that would be, at most Max).
	Moved int
	// Left counts messages dead-lettered again while the redrive ran: they
	// stay for the next redrive, so a redrive ends instead of cycling
	// messages between the queues.
	Left int
	// Waiting is about how many messages the dead-letter queue held when
	// the redrive started; -1 if the broker cannot say.
	Waiting int64
	// InFlight is how many of them were received by someone else and not
	// yet settled; -1 if the broker cannot say.
	InFlight int64
	// Complete, in a dry run, says Moved is exact: every selected message
	// was counted (false when some were in flight, or the broker shows a
	// group's later messages only once earlier ones are gone).
	Complete bool
}

// Operations are the operator's actions that depend on the broker. The
// database side of each (audit rows, deleting inbox rows before a replay,
// choosing which outbox rows to replay, held groups) stays in pkg/redrive,
// which works through this interface alone, whatever the transport.
type Operations interface {
	// Depths reports each named consumer's figures (every consumer when
	// none is named). A queue that cannot be read has its Error set.
	Depths(ctx context.Context, consumers ...string) ([]QueueDepth, error)
	// Redrive moves up to Max messages from the consumer's dead-letter
	// queue back to its queue, in the order they died, each with a fresh
	// retry budget and without the dead-letter diagnostics. A crash midway
	// may deliver a message twice; the inbox drops the copy. A dead-letter
	// queue the transport does not have is ErrNoSuchDLQ.
	Redrive(ctx context.Context, req RedriveRequest) (RedriveResult, error)
	// Replay sends stored events to one consumer only, in the order given
	// (the caller orders them by aggregate and sequence and clears the
	// consumer's inbox rows for them first, so they apply again). Each call
	// uses deduplication ids of its own, so a replay is never dropped as a
	// duplicate of the original delivery.
	Replay(ctx context.Context, consumer string, msgs []outbox.Message) (sent int, err error)
	// Selects reports whether the consumer receives m (its bindings,
	// filter subjects or subscription filter): replay sends a consumer only
	// the events it would have received.
	Selects(consumer string, m outbox.Message) (bool, error)
	// Peek lists a dead-letter queue's messages without taking them:
	// nothing is left in flight and the queue keeps its order.
	Peek(ctx context.Context, req PeekRequest) (PeekResult, error)
	// Discard deletes the selected messages from a dead-letter queue for
	// good, leaving every other message where it was, in order.
	Discard(ctx context.Context, req DiscardRequest) (DiscardResult, error)
}

// Transport bundles one broker's implementations, so the wiring (Lambda
// mains, the CLI, make local) opens a transport in one place (Open) and
// uses the same calls whichever it is. An accessor returns an error when
// the transport's configuration lacks what that use needs (SNS: a topic
// ARN to publish), naming the variable.
type Transport interface {
	Kind() Kind
	// String describes the broker and its topology in one line, without
	// credentials (make local prints it).
	String() string
	// Publisher is safe for the dispatcher's concurrent Publish calls.
	Publisher() (Publisher, error)
	Provisioner() (Provisioner, error)
	Operations() (Operations, error)
	// Consumer returns a runner applying the named consumer's messages
	// with apply through the inbox in db, as a long-running process.
	Consumer(name string, db inbox.DB, apply inbox.Apply) (Runner, error)
	// Close releases connections. Runners already returned stop on their own
	// context, not on Close.
	Close() error
}

// Duration is a time.Duration written in JSON as a Go duration string
// ("1.5s", "5m"), so topologies kept as data stay readable.
type Duration time.Duration

// MarshalJSON writes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON reads a duration string.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration: want a string such as \"1s\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("duration %q: %w", s, err)
	}
	*d = Duration(v)
	return nil
}
