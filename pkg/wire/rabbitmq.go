package wire

import (
	"fmt"
	"regexp"
	"strings"
)

// RabbitMQ is a profile's RabbitMQ section: where and how events are
// published, and the exchanges and queues the system's consumers expect,
// declared exactly as its design gives them.
type RabbitMQ struct {
	// Exchange events are published to; it must be one of Exchanges.
	Exchange string `json:"exchange"`
	// RoutingKey template, e.g. "{aggregate_type}.{event_type}". Required
	// for topic and direct exchanges.
	RoutingKey string `json:"routing_key,omitempty"`
	// MessageID template of the message_id property. Default "{event_id}".
	MessageID string `json:"message_id,omitempty"`
	// Timestamp property: "occurred_at" (default: when the event
	// happened), "published" (when fifobox published it) or "none".
	Timestamp string `json:"timestamp,omitempty"`
	// Type template of the type property. Default "{event_type}".
	Type string `json:"type,omitempty"`
	// Headers maps header names to templates or literal numbers and bools.
	Headers map[string]any `json:"headers,omitempty"`
	// Exchanges and Queues are declared as given, in order.
	Exchanges []AMQPExchange `json:"exchanges"`
	Queues    []AMQPQueue    `json:"queues"`
	// PolicyPriority is the priority of the policies fifobox sets for
	// queues with a Policy. Default 10: above a catch-all policy at 0 (a
	// queue follows only its highest-priority matching policy).
	PolicyPriority int `json:"policy_priority,omitempty"`

	headers []header
	msgID   template
	typ     template
	key     template
}

// AMQPExchange is one exchange to declare.
type AMQPExchange struct {
	Name string `json:"name"`
	// Type is direct, fanout, topic, headers or a plugin's x-... type.
	Type string `json:"type"`
	// Durable: default true.
	Durable    *bool          `json:"durable,omitempty"`
	AutoDelete bool           `json:"auto_delete,omitempty"`
	Internal   bool           `json:"internal,omitempty"`
	Arguments  map[string]any `json:"arguments,omitempty"`
}

// AMQPQueue is one queue to declare, with exactly these arguments (a
// consumer declaring it the same way gets no 406), optionally a policy
// (settings a consumer's own declare cannot conflict with, e.g.
// dead-lettering for queues its consumers declare without arguments), and
// its bindings.
type AMQPQueue struct {
	Name string `json:"name"`
	// Durable: default true.
	Durable    *bool          `json:"durable,omitempty"`
	AutoDelete bool           `json:"auto_delete,omitempty"`
	Arguments  map[string]any `json:"arguments,omitempty"`
	// Policy is a RabbitMQ policy definition applied to this queue alone
	// (pattern ^name$), e.g. {"dead-letter-exchange": "x", "dead-letter-routing-key": "q.dlq"}.
	Policy   map[string]any `json:"policy,omitempty"`
	Bindings []AMQPBinding  `json:"bindings,omitempty"`
}

// AMQPBinding binds the queue to an exchange.
type AMQPBinding struct {
	Exchange  string         `json:"exchange"`
	Key       string         `json:"key"`
	Arguments map[string]any `json:"arguments,omitempty"`
}

// IsDurable is Durable with its default.
func (e AMQPExchange) IsDurable() bool { return e.Durable == nil || *e.Durable }

// IsDurable is Durable with its default.
func (q AMQPQueue) IsDurable() bool { return q.Durable == nil || *q.Durable }

// PolicyName is the name of the policy fifobox sets for queue q.
func PolicyName(q string) string { return "fifobox:" + q }

// PolicyPattern matches queue q's name only.
func PolicyPattern(q string) string { return "^" + regexp.QuoteMeta(q) + "$" }

var (
	amqpNameRE   = regexp.MustCompile(`^[A-Za-z0-9._:/-]{1,255}$`)
	amqpHeaderRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,128}$`)
	exchangeType = map[string]bool{"direct": true, "fanout": true, "topic": true, "headers": true}
	// policyKeys are the queue policy definition keys RabbitMQ 3.10+ knows.
	policyKeys = map[string]string{
		"dead-letter-exchange": "string", "dead-letter-routing-key": "string", "dead-letter-strategy": "string",
		"message-ttl": "int", "expires": "int", "max-length": "int", "max-length-bytes": "int",
		"overflow": "string", "delivery-limit": "int", "queue-mode": "string", "queue-version": "int",
		"max-age": "string", "stream-max-segment-size-bytes": "int", "ha-mode": "string", "ha-params": "any",
		"ha-sync-mode": "string", "queue-master-locator": "string", "queue-leader-locator": "string",
		"single-active-consumer": "bool",
	}
)

// DeadLetter returns where the queue's dead letters go (its arguments win
// over its policy, as on the broker), or ok false.
func (q AMQPQueue) DeadLetter() (exchange, key string, ok bool) {
	if x, found := q.Arguments["x-dead-letter-exchange"].(string); found {
		k, _ := q.Arguments["x-dead-letter-routing-key"].(string)
		return x, k, true
	}
	if x, found := q.Policy["dead-letter-exchange"].(string); found {
		k, _ := q.Policy["dead-letter-routing-key"].(string)
		return x, k, true
	}
	return "", "", false
}

func (r *RabbitMQ) prepare(at string) []error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if r.PolicyPriority == 0 {
		r.PolicyPriority = 10
	}
	if r.MessageID == "" {
		r.MessageID = "{event_id}"
	}
	if r.Type == "" {
		r.Type = "{event_type}"
	}
	switch r.Timestamp {
	case "":
		r.Timestamp = "occurred_at"
	case "occurred_at", "published", "none":
	default:
		add("%s.timestamp %q: occurred_at, published or none", at, r.Timestamp)
	}
	var err error
	if r.msgID, err = parseTemplate(r.MessageID); err != nil {
		add("%s.message_id: %v", at, err)
	}
	if r.typ, err = parseTemplate(r.Type); err != nil {
		add("%s.type: %v", at, err)
	}
	if r.key, err = parseTemplate(r.RoutingKey); err != nil {
		add("%s.routing_key: %v", at, err)
	}
	var herrs []error
	r.headers, herrs = compileHeaders(r.Headers, at+".headers", amqpHeaderRE, func(n string) bool {
		return strings.HasPrefix(n, "x-death") || strings.HasPrefix(n, "x-fifobox-")
	})
	errs = append(errs, herrs...)

	exchanges := map[string]AMQPExchange{}
	for i := range r.Exchanges {
		x := &r.Exchanges[i]
		p := fmt.Sprintf("%s.exchanges[%d]", at, i)
		if !amqpNameRE.MatchString(x.Name) || strings.HasPrefix(x.Name, "amq.") {
			add("%s.name %q: 1-255 letters, digits, '.', '_', ':', '/' or '-', not starting with amq.", p, x.Name)
		}
		if _, dup := exchanges[x.Name]; dup {
			add("%s.name %q: declared twice", p, x.Name)
		}
		if !exchangeType[x.Type] && !strings.HasPrefix(x.Type, "x-") {
			add("%s.type %q: direct, fanout, topic, headers or a plugin's x-... type", p, x.Type)
		}
		if x.Arguments, err = normalizeMap(x.Arguments, p+".arguments"); err != nil {
			errs = append(errs, err)
		}
		exchanges[x.Name] = *x
	}
	pub, ok := exchanges[r.Exchange]
	switch {
	case r.Exchange == "":
		add("%s.exchange: required: the exchange events are published to", at)
	case !ok:
		add("%s.exchange %q: not in %s.exchanges (declare it, so provisioning creates it as its consumers expect)", at, r.Exchange, at)
	case (pub.Type == "topic" || pub.Type == "direct") && !r.key.isSet():
		add("%s.routing_key: required for the %s exchange %q", at, pub.Type, r.Exchange)
	}
	if len(r.Queues) == 0 {
		add("%s.queues: at least one queue (events published with no queue bound are refused)", at)
	}
	queues := map[string]bool{}
	for i := range r.Queues {
		q := &r.Queues[i]
		p := fmt.Sprintf("%s.queues[%d]", at, i)
		if !amqpNameRE.MatchString(q.Name) || strings.HasPrefix(q.Name, "amq.") {
			add("%s.name %q: 1-255 letters, digits, '.', '_', ':', '/' or '-', not starting with amq.", p, q.Name)
		}
		if queues[q.Name] {
			add("%s.name %q: declared twice", p, q.Name)
		}
		queues[q.Name] = true
		if q.Arguments, err = normalizeMap(q.Arguments, p+".arguments"); err != nil {
			errs = append(errs, err)
		}
		if q.Policy, err = normalizeMap(q.Policy, p+".policy"); err != nil {
			errs = append(errs, err)
		}
		for _, k := range sortedKeys(q.Policy) {
			want, known := policyKeys[k]
			if !known {
				add("%s.policy[%q]: not a queue policy key RabbitMQ knows (%s)", p, k, strings.Join(sortedKeys(policyKeys), ", "))
				continue
			}
			if !typeIs(q.Policy[k], want) {
				add("%s.policy[%q]: must be a %s", p, k, want)
			}
		}
		if x, _, ok := q.DeadLetter(); ok {
			if _, declared := exchanges[x]; !declared && x != "" {
				add("%s: dead-letter exchange %q is not in %s.exchanges", p, x, at)
			}
		}
		for j, b := range q.Bindings {
			bp := fmt.Sprintf("%s.bindings[%d]", p, j)
			bx, declared := exchanges[b.Exchange]
			if !declared {
				add("%s.exchange %q: not in %s.exchanges", bp, b.Exchange, at)
			}
			if len(b.Key) > 255 {
				add("%s.key: at most 255 bytes", bp)
			}
			if declared && bx.Type == "topic" && b.Key != "" && !topicPatternOK(b.Key) {
				add("%s.key %q: topic binding keys are dot-separated words, * or #", bp, b.Key)
			}
			if q.Bindings[j].Arguments, err = normalizeMap(b.Arguments, bp+".arguments"); err != nil {
				errs = append(errs, err)
			}
		}
	}
	// A dead letter that no queue is bound to receive is dropped by the
	// broker without a trace: refuse such a layout before anything runs.
	for i, q := range r.Queues {
		x, key, ok := q.DeadLetter()
		if !ok {
			continue
		}
		if x == "" {
			if !queues[key] {
				add("%s.queues[%d]: dead letters go through the default exchange to queue %q, which is not declared: they would be dropped", at, i, key)
			}
			continue
		}
		if !r.boundFor(exchanges[x], key) {
			add("%s.queues[%d]: dead letters go to exchange %q with routing key %q, but no queue in %s.queues is bound there: the broker would drop them", at, i, x, key, at)
		}
	}
	return errs
}

// boundFor reports whether some declared queue receives a message sent to
// exchange x with routing key key.
func (r *RabbitMQ) boundFor(x AMQPExchange, key string) bool {
	for _, q := range r.Queues {
		for _, b := range q.Bindings {
			if b.Exchange != x.Name {
				continue
			}
			switch x.Type {
			case "fanout", "headers":
				return true
			case "topic":
				if topicMatch(b.Key, key) {
					return true
				}
			default:
				if b.Key == key {
					return true
				}
			}
		}
	}
	return false
}

func typeIs(v any, want string) bool {
	switch want {
	case "string":
		_, ok := v.(string)
		return ok
	case "int":
		_, ok := v.(int64)
		return ok
	case "bool":
		_, ok := v.(bool)
		return ok
	}
	return true
}

func topicPatternOK(k string) bool {
	for _, w := range strings.Split(k, ".") {
		if w == "" {
			return false
		}
	}
	return true
}

// topicMatch reports whether routing key key matches topic binding pattern.
func topicMatch(pattern, key string) bool {
	return matchWords(strings.Split(pattern, "."), strings.Split(key, "."))
}

func matchWords(p, k []string) bool {
	if len(p) == 0 {
		return len(k) == 0
	}
	switch p[0] {
	case "#":
		for i := 0; i <= len(k); i++ {
			if matchWords(p[1:], k[i:]) {
				return true
			}
		}
		return false
	case "*":
		return len(k) > 0 && matchWords(p[1:], k[1:])
	}
	return len(k) > 0 && p[0] == k[0] && matchWords(p[1:], k[1:])
}

// Selects reports whether a message published with routing key key
// reaches at least one of the profile's queues (a headers exchange: any
// bound queue counts). A transport's unrouted-event policy asks it, as it
// asks its own topology without a profile.
func (r *RabbitMQ) Selects(key string) bool {
	for _, x := range r.Exchanges {
		if x.Name == r.Exchange {
			return r.boundFor(x, key)
		}
	}
	return false
}
