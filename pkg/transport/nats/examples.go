package nats

import (
	"time"

	"github.com/fifobox/fifobox/pkg/transport"
)

// Holdco is the holding company's layout on JetStream: stream HOLDCO,
// subjects "holdco.<aggregate_type>.<event_type>" (single-word event types:
// "holdco.invoice.paid"), and the analytics (every event), erp (invoices and
// payment intents) and notifications (orders and failed payments) consumers.
func Holdco() Topology {
	return Topology{
		Stream:        "HOLDCO",
		SubjectPrefix: "holdco",
		Subject:       "{aggregate_type}.{event_type}",
		Consumers: []Consumer{
			{Name: "analytics", Filters: []string{">"}},
			{Name: "erp", Filters: []string{"invoice.*", "payment_intent.*"}},
			{Name: "notifications", Filters: []string{"order.*", "payment_intent.failed"}},
		},
	}
}

// Ticketing is the ticketing platform's layout: the event type alone after
// the prefix ("ticketing.hold_created": the dot in "hold.created" is
// sanitised), an inventory and a notification consumer, and failed messages
// retried three times (1s, 2s, 4s) before they are dead-lettered.
func Ticketing() Topology {
	retry := transport.RetryPolicy{MaxRetries: 3, InitialDelay: transport.Duration(time.Second), Multiplier: 2, MaxDelay: transport.Duration(time.Minute)}
	return Topology{
		Stream:        "TICKETING",
		SubjectPrefix: "ticketing",
		Subject:       "{event_type}",
		Consumers: []Consumer{
			{Name: "inventory", Retry: retry, Filters: []string{"hold_created", "hold_expired", "order_confirmed"}},
			{Name: "notification", Retry: retry, Filters: []string{"order_confirmed", "order_cancelled"}},
		},
	}
}

// Corewrite is the platform whose subscribers each get every event.
func Corewrite() Topology {
	return Topology{
		Stream:        "COREWRITE",
		SubjectPrefix: "corewrite",
		Consumers: []Consumer{
			{Name: "search-indexer", Filters: []string{">"}},
			{Name: "cache-invalidator", Filters: []string{">"}},
		},
	}
}
