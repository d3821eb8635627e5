package transport

import (
	"fmt"
	"log/slog"

	"github.com/fifobox/fifobox/pkg/outbox"
)

// Policies for an unrouted event: one that no consumer of the topology
// selects (no binding, filter or subject matches it). Every transport
// applies the topology's policy the same way, and none ever holds the
// event's aggregate back for it.
const (
	// UnroutedDeliver (the default) counts the event as delivered, as SNS
	// does with a message no subscription's filter accepts, and reports it:
	// one UnroutedLogMessage line per event, which the deployment counts
	// as the UnroutedEvents metric and alarms on.
	UnroutedDeliver = "deliver"
	// UnroutedAlternate sends the event to the topology's catch-all
	// instead (RabbitMQ: an alternate exchange and its queue; NATS: a
	// subject the dead-letter stream keeps), where it waits for an
	// operator; it is reported the same way.
	UnroutedAlternate = "alternate"
)

// UnroutedLogMessage is the message of the log line a publisher writes for
// each unrouted event (infra's metric filter counts these lines).
const UnroutedLogMessage = "fifobox: unrouted event"

// CheckUnroutedPolicy reports an unknown policy; "" means UnroutedDeliver.
func CheckUnroutedPolicy(p string) error {
	switch p {
	case "", UnroutedDeliver, UnroutedAlternate:
		return nil
	}
	return fmt.Errorf("unrouted.policy %q: must be %s or %s", p, UnroutedDeliver, UnroutedAlternate)
}

// LogUnrouted writes the line for one unrouted event: which event, which
// policy, where it went. Never the payload or the aggregate id.
func LogUnrouted(log *slog.Logger, kind Kind, policy string, m *outbox.Message, sentTo string) {
	log.Warn(UnroutedLogMessage, "transport", string(kind), "policy", policy, "event_id", m.EventID,
		"event_type", m.EventType, "aggregate_type", m.AggregateType, "sent_to", sentTo, "unrouted", 1)
}
