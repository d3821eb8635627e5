package amqp

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Exchange kinds.
const (
	KindTopic   = "topic"
	KindFanout  = "fanout"
	KindHeaders = "headers"
	KindDirect  = "direct"
)

// Queue types.
const (
	QueueQuorum  = "quorum"
	QueueClassic = "classic"
)

// Headers fifobox sets on messages it dead-letters itself, and reads back
// when redriving (they are removed then).
const (
	HeaderErrorClass  = "x-fifobox-error-class"
	HeaderErrorReason = "x-fifobox-error-reason"
	HeaderConsumer    = "x-fifobox-consumer"
	HeaderDeadAt      = "x-fifobox-dead-at"
	// HeaderRedriven counts how often a message was moved back from the DLQ.
	HeaderRedriven = "x-fifobox-redriven"
)

// DefaultAttemptsHeader is the header counting a message's failed deliveries
// (0 when published); the retry path increments it.
const DefaultAttemptsHeader = "x-attempts"

// Topology is a RabbitMQ messaging layout as data: where the dispatcher
// publishes, how a message's routing key and headers are made, and per
// consumer a durable queue with its bindings, retry queues and dead-letter
// queue. Provisioner creates it idempotently; Publisher, Runner, the Lambda
// handler and Operations all read names from it, so they cannot drift.
type Topology struct {
	// Exchange is where events are published. Required.
	Exchange Exchange `json:"exchange"`
	// RoutingKey is the routing key template, e.g. "{aggregate_type}.{event_type}"
	// or "{event_type}" (fields: event_id, event_type, aggregate_type,
	// aggregate_id, sequence, tenant_id, traceparent). Required for topic and
	// direct exchanges; fanout and headers exchanges ignore it.
	RoutingKey string `json:"routing_key,omitempty"`
	// Headers maps header names to templates; a header whose template is a
	// single field that is empty for a message (an optional tenant id) is
	// left out of that message.
	Headers map[string]string `json:"headers,omitempty"`
	// AttemptsHeader counts a message's failed deliveries: 0 when published,
	// n on its n-th retry. Default "x-attempts".
	AttemptsHeader string `json:"attempts_header,omitempty"`
	// DeadLetterExchange is a direct exchange; each consumer's DLQ is bound
	// to it with the key "<queue>.dlq", and each queue dead-letters to it with
	// that key. Default "<exchange>.dlx".
	DeadLetterExchange string `json:"dead_letter_exchange,omitempty"`
	// QueueType is "quorum" (replicated; Amazon MQ for RabbitMQ 3.13 and
	// later, the default on 4.x) or "classic" (older brokers). Default quorum.
	QueueType string `json:"queue_type,omitempty"`
	// Consumers each get a queue, retry queues and a DLQ.
	Consumers []Consumer `json:"consumers"`
	// Unrouted is what happens to an event no consumer's binding selects.
	// Default: delivered and reported (transport.UnroutedDeliver).
	Unrouted Unrouted `json:"unrouted,omitzero"`

	routingKey transport.Template
	headers    map[string]transport.Template
}

// Exchange names the exchange events are published to.
type Exchange struct {
	// Name of the exchange; must not start with "amq." (reserved).
	Name string `json:"name"`
	// Kind is topic, fanout, headers or direct.
	Kind string `json:"kind"`
}

// Consumer is one subscriber: a durable queue with single active consumer
// (one process applies it at a time, so its order is the queue's order),
// its bindings, retry queues and dead-letter queue.
type Consumer struct {
	// Name is the consumer's inbox key. Letters, digits, '-', '_' and '.'.
	Name string `json:"name"`
	// Queue is the queue's name. Default Name.
	Queue string `json:"queue,omitempty"`
	// Bindings select the events the queue receives: routing key patterns
	// for topic and direct exchanges, header matches for a headers
	// exchange, none for a fanout exchange (it gets every event).
	Bindings []Binding `json:"bindings,omitempty"`
	// Retry is the redelivery schedule for transient failures; the zero
	// value means transport.RetryPolicy's defaults (5 retries, 1s doubling,
	// capped at 5m). Each retry n waits in the queue "<queue>.retry.<n>".
	Retry transport.RetryPolicy `json:"retry"`
	// MaxLength, if > 0, bounds the queue: a publish that would exceed it is
	// refused (the publisher confirm is a nack, so the dispatcher retries
	// later) rather than dropping the oldest message.
	MaxLength int `json:"max_length,omitempty"`
	// DeliveryLimit (quorum queues only) dead-letters a message that comes
	// back unsettled after this many redeliveries (it is delivered
	// DeliveryLimit+1 times): a consumer that crashes on it every time
	// cannot stall the queue for ever. The runner holds the message's
	// aggregate (strict order) before its last delivery runs. A policy can
	// lower the queue's limit, not raise it. Default 20.
	DeliveryLimit int `json:"delivery_limit,omitempty"`
	// Prefetch is how many unacknowledged messages the runner holds. Default 200.
	Prefetch int `json:"prefetch,omitempty"`
	// Workers is how many aggregates the runner applies at once. Default 8.
	Workers int `json:"workers,omitempty"`
}

// Unrouted is the topology's policy for events that no consumer's binding
// selects (see transport.UnroutedDeliver and transport.UnroutedAlternate).
type Unrouted struct {
	// Policy is "deliver" (default: the publish counts as delivered and is
	// reported) or "alternate" (the events exchange gets an alternate
	// exchange, "<exchange>.unrouted", whose one queue keeps such events).
	Policy string `json:"policy,omitempty"`
	// Queue is the catch-all queue of the alternate policy. Default
	// "<exchange>.unrouted".
	Queue string `json:"queue,omitempty"`
}

// AlternateExchange is the fanout exchange unrouted events go to under the
// alternate policy, "<exchange>.unrouted" ("" under the deliver policy).
func (t *Topology) AlternateExchange() string {
	if t.Unrouted.Policy != transport.UnroutedAlternate {
		return ""
	}
	return t.Exchange.Name + ".unrouted"
}

// selectedByAny reports whether some consumer's bindings select m.
func (t *Topology) selectedByAny(m *outbox.Message) bool {
	for _, c := range t.Consumers {
		if t.selects(c, m) {
			return true
		}
	}
	return false
}

// Binding is one binding of a consumer's queue to the exchange.
type Binding struct {
	// Key is the binding key (topic: words with * and #; direct: exact).
	Key string `json:"key,omitempty"`
	// Headers (headers exchange): every listed header must have the value.
	Headers map[string]string `json:"headers,omitempty"`
}

// QueueName is the consumer's queue.
func (c Consumer) QueueName() string {
	if c.Queue != "" {
		return c.Queue
	}
	return c.Name
}

// DLQName is the consumer's dead-letter queue, "<queue>.dlq"; it is also the
// routing key that the dead-letter exchange routes to it with.
func (c Consumer) DLQName() string { return c.QueueName() + ".dlq" }

// SettleExchange is the consumer's own direct exchange, "<queue>.settle",
// bound to its retry queues and its DLQ (each by its name): the consumer
// publishes its retries and dead letters there, so its broker user may write
// to that exchange only, never into another consumer's queues.
func (c Consumer) SettleExchange() string { return c.QueueName() + ".settle" }

// RetryQueueName is the queue holding messages waiting for retry n
// (1-based): "<queue>.retry.<delay>", e.g. "orders.retry.4s". Naming it by
// its delay rather than its number lets a changed schedule create new queues
// (the old ones drain back into the consumer's queue) instead of failing on
// a queue whose TTL differs, and lets retries with the same capped delay
// share one queue.
func (c Consumer) RetryQueueName(n int) string {
	d := c.Retry.Delay(n)
	if d%time.Second == 0 {
		return fmt.Sprintf("%s.retry.%ds", c.QueueName(), d/time.Second)
	}
	return fmt.Sprintf("%s.retry.%dms", c.QueueName(), d.Milliseconds())
}

// RetryQueues lists the consumer's distinct retry queues with their delays,
// shortest first.
func (c Consumer) RetryQueues() []RetryQueue {
	var out []RetryQueue
	for n := 1; n <= c.Retry.MaxRetries; n++ {
		name := c.RetryQueueName(n)
		if len(out) > 0 && out[len(out)-1].Name == name {
			continue
		}
		out = append(out, RetryQueue{Name: name, Delay: c.Retry.Delay(n)})
	}
	return out
}

// RetryQueue is one retry delay queue.
type RetryQueue struct {
	Name  string
	Delay time.Duration
}

// Consumer returns the consumer with the given name.
func (t *Topology) Consumer(name string) (Consumer, bool) {
	for _, c := range t.Consumers {
		if c.Name == name {
			return c, true
		}
	}
	return Consumer{}, false
}

// ConsumerByQueue returns the consumer whose queue is queue.
func (t *Topology) ConsumerByQueue(queue string) (Consumer, bool) {
	for _, c := range t.Consumers {
		if c.QueueName() == queue {
			return c, true
		}
	}
	return Consumer{}, false
}

// setDefaults fills defaults in place.
func (t *Topology) setDefaults() {
	if t.AttemptsHeader == "" {
		t.AttemptsHeader = DefaultAttemptsHeader
	}
	if t.DeadLetterExchange == "" && t.Exchange.Name != "" {
		t.DeadLetterExchange = t.Exchange.Name + ".dlx"
	}
	if t.QueueType == "" {
		t.QueueType = QueueQuorum
	}
	if t.Unrouted.Policy == "" {
		t.Unrouted.Policy = transport.UnroutedDeliver
	}
	if t.Unrouted.Policy == transport.UnroutedAlternate && t.Unrouted.Queue == "" && t.Exchange.Name != "" {
		t.Unrouted.Queue = t.Exchange.Name + ".unrouted"
	}
	for i := range t.Consumers {
		c := &t.Consumers[i]
		c.Retry = c.Retry.WithDefaults()
		if c.DeliveryLimit == 0 && t.QueueType == QueueQuorum {
			c.DeliveryLimit = 20
		}
		if c.Prefetch == 0 {
			c.Prefetch = 200
		}
		if c.Workers == 0 {
			c.Workers = 8
		}
	}
}

var (
	consumerNameRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,100}$`)
	// AMQP short strings are at most 255 bytes; the longest suffix added to a
	// queue name is ".retry.<ms>ms".
	entityNameRE = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,200}$`)
	headerNameRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,128}$`)
)

// Prepare applies defaults, validates every field and parses the templates.
// Publisher, Provisioner and the consumers call it; call it yourself to
// check a topology kept as data.
func (t *Topology) Prepare() error {
	t.setDefaults()
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	if !entityNameRE.MatchString(t.Exchange.Name) || strings.HasPrefix(t.Exchange.Name, "amq.") {
		add("exchange.name %q: must be 1-200 letters, digits, '.', '_', ':' or '-', not starting with amq.", t.Exchange.Name)
	}
	switch t.Exchange.Kind {
	case KindTopic, KindDirect:
		if t.RoutingKey == "" {
			add("routing_key: required for a %s exchange", t.Exchange.Kind)
		}
	case KindFanout, KindHeaders:
	default:
		add("exchange.kind %q: must be topic, fanout, headers or direct", t.Exchange.Kind)
	}
	var err error
	if t.routingKey, err = transport.ParseTemplate(t.RoutingKey); err != nil {
		add("routing_key: %v", err)
	}
	t.headers = map[string]transport.Template{}
	for _, name := range sortedKeys(t.Headers) {
		if !headerNameRE.MatchString(name) {
			add("headers[%q]: header names are 1-128 letters, digits, '.', '_' or '-'", name)
		}
		if name == t.AttemptsHeader || strings.HasPrefix(name, "x-fifobox-") || strings.HasPrefix(name, "x-death") {
			add("headers[%q]: reserved (attempts header, x-fifobox-*, x-death)", name)
		}
		tpl, err := transport.ParseTemplate(t.Headers[name])
		if err != nil {
			add("headers[%q]: %v", name, err)
		}
		t.headers[name] = tpl
	}
	if !headerNameRE.MatchString(t.AttemptsHeader) {
		add("attempts_header %q: 1-128 letters, digits, '.', '_' or '-'", t.AttemptsHeader)
	}
	if !entityNameRE.MatchString(t.DeadLetterExchange) || strings.HasPrefix(t.DeadLetterExchange, "amq.") || t.DeadLetterExchange == t.Exchange.Name {
		add("dead_letter_exchange %q: must be a valid exchange name other than the events exchange", t.DeadLetterExchange)
	}
	if t.QueueType != QueueQuorum && t.QueueType != QueueClassic {
		add("queue_type %q: must be quorum or classic", t.QueueType)
	}
	if len(t.Consumers) == 0 {
		add("consumers: at least one consumer is required")
	}
	if err := transport.CheckUnroutedPolicy(t.Unrouted.Policy); err != nil {
		add("%v", err)
	}
	names, queues := map[string]bool{}, map[string]bool{}
	if t.Unrouted.Policy == transport.UnroutedAlternate {
		q := t.Unrouted.Queue
		if !entityNameRE.MatchString(q) || strings.HasPrefix(q, "amq.") {
			add("unrouted.queue %q: must be 1-200 letters, digits, '.', '_', ':' or '-', not starting with amq.", q)
		}
		queues[q] = true
	} else if t.Unrouted.Queue != "" {
		add("unrouted.queue %q: only with policy %s", t.Unrouted.Queue, transport.UnroutedAlternate)
	}
	for i, c := range t.Consumers {
		p := fmt.Sprintf("consumers[%d]", i)
		if !consumerNameRE.MatchString(c.Name) {
			add("%s.name %q: must be 1-100 letters, digits, '.', '_' or '-'", p, c.Name)
		}
		if names[c.Name] {
			add("%s.name %q: duplicate", p, c.Name)
		}
		names[c.Name] = true
		q := c.QueueName()
		if !entityNameRE.MatchString(q) || strings.HasPrefix(q, "amq.") {
			add("%s.queue %q: must be 1-200 letters, digits, '.', '_', ':' or '-', not starting with amq.", p, q)
		}
		if queues[q] {
			add("%s.queue %q: used by two consumers", p, q)
		}
		queues[q] = true
		switch t.Exchange.Kind {
		case KindFanout:
			if len(c.Bindings) > 0 {
				add("%s.bindings: a fanout exchange sends every event to every queue; remove the bindings", p)
			}
		case KindHeaders:
			if len(c.Bindings) == 0 {
				add("%s.bindings: at least one header binding is required", p)
			}
			for j, b := range c.Bindings {
				if b.Key != "" {
					add("%s.bindings[%d]: a headers exchange binds on headers only (no headers: every event)", p, j)
				}
			}
		default:
			if len(c.Bindings) == 0 {
				add("%s.bindings: at least one binding key is required", p)
			}
			for j, b := range c.Bindings {
				if b.Key == "" || len(b.Key) > 255 || len(b.Headers) > 0 {
					add("%s.bindings[%d]: a %s exchange binds on a key of 1-255 bytes only", p, j, t.Exchange.Kind)
				}
			}
		}
		if err := c.Retry.Validate(); err != nil {
			add("%s.retry: %v", p, err)
		}
		if c.MaxLength < 0 {
			add("%s.max_length %d: must not be negative", p, c.MaxLength)
		}
		if c.DeliveryLimit < 0 || (c.DeliveryLimit > 0 && t.QueueType != QueueQuorum) {
			add("%s.delivery_limit %d: quorum queues only, and not negative", p, c.DeliveryLimit)
		}
		if c.Prefetch < 1 || c.Prefetch > 10000 {
			add("%s.prefetch %d: must be 1-10000", p, c.Prefetch)
		}
		if c.Workers < 1 || c.Workers > 1000 {
			add("%s.workers %d: must be 1-1000", p, c.Workers)
		}
	}
	return errors.Join(errs...)
}

// queueArgs are the consumer queue's arguments.
func (t *Topology) queueArgs(c Consumer) amqp091.Table {
	a := amqp091.Table{
		"x-queue-type":              t.QueueType,
		"x-single-active-consumer":  true,
		"x-dead-letter-exchange":    t.DeadLetterExchange,
		"x-dead-letter-routing-key": c.DLQName(),
	}
	if t.QueueType == QueueQuorum {
		// At-least-once dead-lettering needs reject-publish overflow; it keeps
		// a message in the queue until its DLQ has confirmed it.
		a["x-overflow"] = "reject-publish"
		a["x-dead-letter-strategy"] = "at-least-once"
		if c.DeliveryLimit > 0 {
			a["x-delivery-limit"] = int64(c.DeliveryLimit)
		}
	}
	if c.MaxLength > 0 {
		a["x-max-length"] = int64(c.MaxLength)
		a["x-overflow"] = "reject-publish"
	}
	return a
}

// retryQueueArgs hold a message for the queue's delay, then dead-letter it
// back to the consumer's queue through the default exchange.
func (t *Topology) retryQueueArgs(c Consumer, delay time.Duration) amqp091.Table {
	a := amqp091.Table{
		"x-queue-type":              t.QueueType,
		"x-message-ttl":             delay.Milliseconds(),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": c.QueueName(),
	}
	if t.QueueType == QueueQuorum {
		a["x-overflow"] = "reject-publish"
		a["x-dead-letter-strategy"] = "at-least-once"
	}
	return a
}

func (t *Topology) dlqArgs() amqp091.Table { return amqp091.Table{"x-queue-type": t.QueueType} }

// ParseTopology reads a topology from JSON and prepares it.
func ParseTopology(b []byte) (Topology, error) {
	var t Topology
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&t); err != nil {
		return Topology{}, fmt.Errorf("parse amqp topology: %w", err)
	}
	if err := t.Prepare(); err != nil {
		return Topology{}, fmt.Errorf("amqp topology: %w", err)
	}
	return t, nil
}

// LoadTopology returns a built-in topology by name ("default", "holdco",
// "ticketing", "corewrite"), parses one given as JSON (a value starting
// with "{"), or reads one from a JSON file.
func LoadTopology(nameOrPath string) (Topology, error) {
	var t Topology
	switch nameOrPath {
	case "", "default":
		t = FromTopology(topology.Default())
	case "holdco":
		t = Holdco()
	case "ticketing":
		t = Ticketing()
	case "corewrite":
		t = Corewrite()
	default:
		if strings.HasPrefix(strings.TrimSpace(nameOrPath), "{") {
			// The JSON itself: a Lambda has no file to point at.
			return ParseTopology([]byte(nameOrPath))
		}
		b, err := os.ReadFile(nameOrPath)
		if err != nil {
			return Topology{}, fmt.Errorf("load amqp topology: %w", err)
		}
		return ParseTopology(b)
	}
	if err := t.Prepare(); err != nil {
		return Topology{}, fmt.Errorf("amqp topology %s: %w", nameOrPath, err)
	}
	return t, nil
}

// FromTopology maps fifobox's transport-neutral topology (consumers with
// SNS-style attribute filters) onto RabbitMQ: a headers exchange
// "fifobox.events" whose messages carry the filterable attributes as
// headers, one queue per consumer bound with one header match per allowed
// combination of values (the same exact-match semantics as an SNS filter
// policy), and the consumer's retry budget (topology.Consumer.Retries).
// The redelivery backstop is the quorum queue's delivery_limit.
func FromTopology(tp topology.Topology) Topology {
	t := Topology{
		Exchange:   Exchange{Name: "fifobox.events", Kind: KindHeaders},
		RoutingKey: "{aggregate_type}.{event_type}",
		Headers: map[string]string{
			envelope.AttrEventType:     "{event_type}",
			envelope.AttrAggregateType: "{aggregate_type}",
			envelope.AttrTenantID:      "{tenant_id}",
			envelope.AttrTraceparent:   "{traceparent}",
		},
	}
	for _, c := range tp.Consumers {
		ac := Consumer{Name: c.Name, Retry: transport.RetryPolicy{
			MaxRetries: c.Retries(), InitialDelay: transport.Duration(time.Second),
			Multiplier: 2, MaxDelay: transport.Duration(5 * time.Minute)}}
		for _, m := range headerCombinations(c.Filter) {
			ac.Bindings = append(ac.Bindings, Binding{Headers: m})
		}
		if len(ac.Bindings) == 0 {
			// No filter: a headers binding with no conditions matches every event.
			ac.Bindings = []Binding{{}}
		}
		t.Consumers = append(t.Consumers, ac)
	}
	return t
}

// headerCombinations expands {"a": [1,2], "b": [3]} into [{a:1,b:3} {a:2,b:3}].
func headerCombinations(f map[string][]string) []map[string]string {
	if len(f) == 0 {
		return nil
	}
	out := []map[string]string{{}}
	for _, k := range sortedKeys(f) {
		var next []map[string]string
		for _, m := range out {
			for _, v := range f[k] {
				n := make(map[string]string, len(m)+1)
				for a, b := range m {
					n[a] = b
				}
				n[k] = v
				next = append(next, n)
			}
		}
		out = next
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
