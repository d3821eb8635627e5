package transport

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// QueueState says whether a queue's figures could be read.
type QueueState string

// Queue states, in QueueDepth and in `fifobox status --json`.
const (
	// StateOK: the figures are the broker's.
	StateOK QueueState = "ok"
	// StateMissing: the broker answered that the queue does not exist (not
	// provisioned, deleted, a consumer the topology or FIFOBOX_QUEUES lacks).
	StateMissing QueueState = "missing"
	// StateUnreachable: the broker did not answer (down, wrong endpoint,
	// network).
	StateUnreachable QueueState = "unreachable"
	// StateError: the broker answered with an error (permissions, throttling).
	StateError QueueState = "error"
	// StateNone: the transport has no such queue for this consumer (a
	// subscription DLQ outside SNS); its figures are 0.
	StateNone QueueState = "none"
)

// Unreachable reports whether err means the broker or database could not be
// reached at all (a refused or timed-out connection, an unknown host), as
// opposed to an answer that was an error.
func Unreachable(err error) bool {
	var op *net.OpError
	var dns *net.DNSError
	return errors.As(err, &op) || errors.As(err, &dns)
}

// DLQMessage is one dead-lettered message as an operator sees it: what it
// is and why it died. Its body is there only when asked for (Peek with
// Bodies).
type DLQMessage struct {
	// Key identifies the message on every transport: its event id, or for a
	// body that is not a valid envelope "sha256:" and the hex SHA-256 of the
	// body (the key strict order's holds use, inbox_held.message_key).
	Key string `json:"key"`
	// ID is the broker's own id, if it has one (SQS MessageId, the
	// dead-letter stream's sequence, the AMQP message-id property).
	ID string `json:"id,omitempty"`
	// Group is the message group: the aggregate id.
	Group         string `json:"group"`
	EventType     string `json:"event_type,omitempty"`
	AggregateType string `json:"aggregate_type,omitempty"`
	Sequence      int64  `json:"sequence,omitempty"`
	// ErrorClass and ErrorReason say why it died (invalid, permanent,
	// transient), as the consumer recorded it; empty when the broker moved
	// it by itself (SQS after maxReceiveCount).
	ErrorClass  string `json:"error_class,omitempty"`
	ErrorReason string `json:"error_reason,omitempty"`
	// DeadAt is when it was dead-lettered, when known.
	DeadAt *time.Time `json:"dead_at,omitempty"`
	// Body is the message body, only when asked for.
	Body string `json:"body,omitempty"`
}

// Describe fills in m's key, group (unless set), event type, aggregate type
// and sequence from its body.
func (m *DLQMessage) Describe(body []byte) {
	e, err := envelope.Decode(body)
	if err != nil {
		sum := sha256.Sum256(body)
		m.Key = "sha256:" + hex.EncodeToString(sum[:])
		return
	}
	m.Key, m.EventType, m.AggregateType, m.Sequence = e.ID, e.Type, e.AggregateType, e.Sequence
	if m.Group == "" {
		m.Group = e.AggregateID
	}
}

// DLQSelection chooses messages of one consumer's dead-letter queue: those
// of the given groups, or with the given keys (DLQMessage.Key or ID), or
// every message when both are empty.
type DLQSelection struct {
	// Consumer names the consumer. Required.
	Consumer string
	// From is the dead-letter queue; "" is ConsumerDLQ.
	From DLQ
	// Groups selects messages by message group (aggregate id).
	Groups []string
	// Aggregates selects messages by aggregate: "type/id", or an id alone
	// (any type).
	Aggregates []string
	// Keys selects messages by key or broker id.
	// (A message is selected when any of Groups, Aggregates or Keys takes it.)
	Keys []string
}

// All reports whether the selection takes every message.
func (s DLQSelection) All() bool {
	return len(s.Groups) == 0 && len(s.Keys) == 0 && len(s.Aggregates) == 0
}

// Matches reports whether the selection takes m.
func (s DLQSelection) Matches(m DLQMessage) bool {
	if s.All() {
		return true
	}
	return slices.Contains(s.Groups, m.Group) || slices.Contains(s.Keys, m.Key) || (m.ID != "" && slices.Contains(s.Keys, m.ID)) ||
		slices.Contains(s.Aggregates, m.Group) || (m.AggregateType != "" && slices.Contains(s.Aggregates, m.AggregateType+"/"+m.Group))
}

// Validate checks the selection's consumer and source.
func (s DLQSelection) Validate() error {
	if s.Consumer == "" {
		return errors.New("consumer is required")
	}
	if s.From != "" && s.From != ConsumerDLQ && s.From != SubscriptionDLQ {
		return fmt.Errorf("dead-letter queue %q: want %s or %s", s.From, ConsumerDLQ, SubscriptionDLQ)
	}
	return nil
}

// PeekRequest asks for the messages of a dead-letter queue without taking
// them: nothing is left in flight, and the queue's order is kept.
type PeekRequest struct {
	DLQSelection
	// Limit bounds how many messages come back (at least 1).
	Limit int
	// Bodies includes each message's body.
	Bodies bool
}

// PeekResult is what a peek saw.
type PeekResult struct {
	// Messages in the queue's order (per group, the order they died in).
	Messages []DLQMessage
	// Total is about how many messages the queue holds; -1 if unknown.
	Total int64
	// Complete is true when every message of the queue was looked at;
	// false when the limit was reached or the broker shows some only after
	// earlier ones are gone (an SQS FIFO queue hands out a group's next
	// message only once the one before it is deleted).
	Complete bool
}

// DiscardRequest deletes selected messages from a dead-letter queue for
// good.
type DiscardRequest struct {
	DLQSelection
	// Max bounds how many messages are deleted (at least 1).
	Max int
	// DryRun finds the messages and deletes none.
	DryRun bool
	// Progress, if set, is called as messages are looked at: done of total
	// (-1 if unknown).
	Progress func(done, total int64)
}

// DiscardResult lists what a discard deleted (or, in a dry run, would).
type DiscardResult struct {
	// Discarded messages, in the order they were found.
	Discarded []DLQMessage
	// Missing are the requested keys that were not found: not in the queue,
	// or (SQS) behind earlier messages of their group.
	Missing []string
	// Complete is false when some selected messages may remain because the
	// broker could not show them (see PeekResult.Complete).
	Complete bool
}
