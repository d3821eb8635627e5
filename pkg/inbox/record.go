package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Record is one delivered message as the consumer engine sees it, whatever
// the broker: the transport fills the exported fields when it receives a
// message and gets the record back in the Broker calls that settle it.
type Record struct {
	// ID names the delivery in logs and settlements: the SQS message id,
	// the AMQP message id, the JetStream stream sequence.
	ID string
	// Group is the ordering group when the broker keeps one itself (SQS
	// FIFO's MessageGroupId). Empty: the envelope's aggregate id, the group
	// the publishers use. Records of one group are applied one after the
	// other, in the order they were submitted.
	Group string
	// Body is the message body (an envelope).
	Body []byte
	// Failures is how many times the event failed before, as far as the
	// message itself says (RabbitMQ's attempts header); the engine adds
	// what it recorded durably (inbox_parked). Redeliveries that were not
	// the event's failures never count.
	Failures int
	// Deliveries is how often the broker delivered the message, this time
	// included (0 when the broker does not say).
	Deliveries int
	// Redelivered says the broker delivered the message before and that
	// delivery was not settled (RabbitMQ's redelivered flag), when it does
	// not count deliveries; Deliveries > 1 says the same. A redelivered
	// record runs alone, after a committed charge (see Engine).
	Redelivered bool
	// LastDelivery says the broker gives up on the message (SQS moves it to
	// the DLQ, JetStream stops delivering it) unless this delivery settles
	// it: a failure now is dead-lettered by the engine, whatever the retry
	// budget, so the group is held rather than losing the message.
	LastDelivery bool
	// Handle is the transport's own delivery (acknowledgement handle,
	// headers to copy); the engine never looks at it.
	Handle any

	env       envelope.Envelope
	decodeErr error
	key       string // event id, or sha256 of an invalid body
	group     string // Group, or the aggregate id; "" for an invalid body without Group
	seq       uint64 // submission order within a session
	charged   bool   // its solo attempt's charge is committed (run.go, charge)
}

// redelivered reports whether an earlier delivery of the record was not
// settled: the previous attempt's outcome may never have been recorded.
func (r *Record) redelivered() bool { return r.Redelivered || r.Deliveries > 1 }

// decode parses the body once, on submission.
func (r *Record) decode() {
	r.env, r.decodeErr = envelope.Decode(r.Body)
	if r.decodeErr == nil {
		r.key = r.env.ID
	} else {
		sum := sha256.Sum256(r.Body)
		r.key = "sha256:" + hex.EncodeToString(sum[:])
	}
	r.group = r.Group
	if r.group == "" && r.decodeErr == nil {
		r.group = r.env.AggregateID
	}
}

// laneKey is what picks the record's lane: its group, or for an invalid
// body with no known group, its id (it orders with nothing).
func (r *Record) laneKey() string {
	if r.group != "" {
		return r.group
	}
	return "invalid/" + r.ID
}

// Envelope is the decoded event; zero when the body is not a valid envelope.
func (r *Record) Envelope() envelope.Envelope { return r.env }

// Key is the event id, or for a body that is not a valid envelope
// "sha256:" and the hex digest of the body (inbox_held's message_key).
func (r *Record) Key() string { return r.key }

// EventID is the event id, or the record's ID when the body is invalid.
func (r *Record) EventID() string {
	if r.decodeErr == nil {
		return r.env.ID
	}
	return r.ID
}

// Settlement actions: what the engine decided for a record and had the
// transport do (ConsumerConfig.OnSettle reports each).
const (
	// ActionApplied: the side effect ran and committed with the inbox claim; acknowledged.
	ActionApplied = "applied"
	// ActionDuplicate: applied before (a redelivery, a redrive's copy); acknowledged.
	ActionDuplicate = "duplicate"
	// ActionRetry: the side effect failed transiently; the event is redelivered
	// after the retry policy's delay and its group is parked behind it.
	ActionRetry = "retry"
	// ActionDeferred: an earlier event of its group is waiting for a retry;
	// this one waits behind it (RabbitMQ: in the head's delay queue;
	// JetStream: held unacknowledged; SQS: reported failed, behind the head
	// in its FIFO group), or it was not started before a Lambda deadline.
	ActionDeferred = "deferred"
	// ActionDeadLetter: invalid, failed permanently, or failed on its last
	// retry: sent to the dead-letter queue with the reason. In strict order
	// its group is held (inbox_held) until redrive or release.
	ActionDeadLetter = "dead-letter"
	// ActionHeld: strict order; an earlier event of its group is
	// dead-lettered, so this one goes to the dead-letter queue behind it.
	ActionHeld = "held"
	// ActionSkipped: not for this consumer (a filter the broker could not
	// apply); acknowledged without touching the inbox.
	ActionSkipped = "skipped"
)

// Settlement is what happened to one delivered record.
type Settlement struct {
	Consumer string
	// RecordID is the transport's id for the delivery (Record.ID).
	RecordID string
	// EventID is the event's id, or for an invalid body the RecordID.
	EventID string
	Action  string
	// Class is the failure class (ClassTransient, ClassPermanent,
	// ClassInvalid, ClassExhausted, ClassHeld, ClassDeadline) for
	// everything but applied, duplicate and skipped.
	Class string
	// Failures is the event's own failed attempts before this delivery.
	Failures int
	// Deliveries is the broker's delivery count, this one included (0 if unknown).
	Deliveries int
	// Envelope is the decoded event (zero when invalid).
	Envelope envelope.Envelope
	Err      error
	// Record is the settled record (its Handle is the transport's).
	Record *Record
}

// Retry is how a transport is to deliver a record again (Broker.Retry).
type Retry struct {
	// N is the retry the record is queued for, 1-based: RabbitMQ's delay
	// queue. A record deferred behind its group's head gets the head's.
	N int
	// Delay is how long from now the record should come back: the retry
	// policy's delay, or for a deferred record the time until its head is
	// due back.
	Delay time.Duration
	// Failures is the event's failure count to carry in the message where
	// the broker allows it (RabbitMQ's attempts header).
	Failures int
	// Behind is the key of the group's retrying head when the record itself
	// did not fail but waits behind it ("" when it failed).
	Behind string
}

// DeadLetter is why a record goes to the dead-letter queue (Broker.DeadLetter).
type DeadLetter struct {
	// Class is ClassInvalid, ClassPermanent, ClassExhausted or ClassHeld.
	Class string
	// Reason says why, for the operator (at most 1,000 bytes; never the payload).
	Reason string
	// Failures is the event's failed attempts, this one included.
	Failures int
}

// Broker is what the engine needs from a transport to settle records it
// received: the transport supplies receive (Session.Submit), acknowledge,
// retry-later and dead-letter. The engine calls these after the inbox
// transaction deciding them committed, one record at a time in each
// group's order. An error means the record was not settled: the session
// fails (Session's onFail), settles nothing more, and the transport lets
// the broker redeliver what is unsettled, which the durable inbox state
// then recognises.
type Broker interface {
	// Ack settles a record that was applied, was a duplicate, or needs
	// nothing more.
	Ack(ctx context.Context, r *Record) error
	// Retry has the record delivered again later, behind nothing newer of
	// its group, and settles this delivery.
	Retry(ctx context.Context, r *Record, rt Retry) error
	// DeadLetter sends the record to the consumer's dead-letter queue with
	// the reason, and settles this delivery.
	DeadLetter(ctx context.Context, r *Record, dl DeadLetter) error
}

// Keeper is implemented by brokers that take back unacknowledged work after
// a timeout (JetStream's AckWait, SQS's visibility timeout): the engine
// calls KeepAlive every KeepAliveEvery with every record it holds, queued,
// running, waiting behind a retrying head or waiting out a database
// outage, so nothing the engine still has is delivered to anyone again.
type Keeper interface {
	KeepAlive(ctx context.Context, rs []*Record)
	KeepAliveEvery() time.Duration
}
