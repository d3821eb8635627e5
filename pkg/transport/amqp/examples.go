package amqp

import (
	"time"

	"github.com/fifobox/fifobox/pkg/transport"
)

// Holdco is the holding company's layout: topic exchange holdco.events,
// routing key "<aggregate_type>.<event_type>", the x-event-id /
// x-aggregate-type / x-aggregate-id / x-event-type / x-attempts headers plus
// the tenant, and a direct DLX holdco.events.dlx routing to "<queue>.dlq".
// Its event types are single words ("created", "paid", "failed"), so the
// routing key has two words and "invoice.*" selects every invoice event.
func Holdco() Topology {
	return Topology{
		Exchange:   Exchange{Name: "holdco.events", Kind: KindTopic},
		RoutingKey: "{aggregate_type}.{event_type}",
		Headers: map[string]string{
			"x-event-id":       "{event_id}",
			"x-aggregate-type": "{aggregate_type}",
			"x-aggregate-id":   "{aggregate_id}",
			"x-event-type":     "{event_type}",
			"x-tenant-id":      "{tenant_id}",
		},
		AttemptsHeader:     "x-attempts",
		DeadLetterExchange: "holdco.events.dlx",
		Consumers: []Consumer{
			{Name: "analytics", Queue: "analytics.ingest", Bindings: []Binding{{Key: "#"}}},
			{Name: "erp", Queue: "erp.sync", Bindings: []Binding{{Key: "invoice.*"}, {Key: "payment_intent.*"}}},
			{Name: "notifications", Queue: "notifications", Bindings: []Binding{{Key: "order.*"}, {Key: "payment_intent.failed"}}},
		},
	}
}

// Ticketing is the ticketing platform's layout: topic exchange
// ticketing.events with the event type as routing key (hold.created,
// hold.expired, order.confirmed, order.cancelled), an inventory queue and a
// notification queue, and failed messages retried three times with
// exponential backoff (1s, 2s, 4s) before they go to the DLQ.
func Ticketing() Topology {
	retry := transport.RetryPolicy{MaxRetries: 3, InitialDelay: transport.Duration(time.Second), Multiplier: 2, MaxDelay: transport.Duration(time.Minute)}
	return Topology{
		Exchange:   Exchange{Name: "ticketing.events", Kind: KindTopic},
		RoutingKey: "{event_type}",
		Headers:    map[string]string{"x-event-id": "{event_id}", "x-tenant-id": "{tenant_id}"},
		Consumers: []Consumer{
			{Name: "inventory", Queue: "ticketing.inventory", Retry: retry,
				Bindings: []Binding{{Key: "hold.*"}, {Key: "order.confirmed"}}},
			{Name: "notification", Queue: "ticketing.notification", Retry: retry,
				Bindings: []Binding{{Key: "order.confirmed"}, {Key: "order.cancelled"}}},
		},
	}
}

// Corewrite is the platform whose subscribers each get every event from
// the fanout exchange corewrite.fanout.
func Corewrite() Topology {
	return Topology{
		Exchange: Exchange{Name: "corewrite.fanout", Kind: KindFanout},
		Headers:  map[string]string{"x-event-id": "{event_id}", "x-event-type": "{event_type}"},
		Consumers: []Consumer{
			{Name: "search-indexer", Queue: "corewrite.search-indexer"},
			{Name: "cache-invalidator", Queue: "corewrite.cache-invalidator"},
		},
	}
}
