package stacks_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/aws/aws-cdk-go/awscdk/v2/assertions"
	"github.com/aws/jsii-runtime-go"

	"github.com/fifobox/fifobox/infra/stacks"
)

// asJSON is v as JSON, for looking for names anywhere in a template value.
func asJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// noSubscriberWarnings are the synth warnings that the alarm topic reaches nobody.
func noSubscriberWarnings(s *synthesised) int {
	ann := assertions.Annotations_FromStack(s.statelessStack.Stack)
	return len(*ann.FindWarning(jsii.String("*"), assertions.Match_StringLikeRegexp(jsii.String("the alarm topic has no subscriber.*"))))
}

// TestSynthWarnsWhenNoAlarmReachesAnyone: without -c alarmEmail the alarm
// topic has no subscriber, and synth says so; with it, it does not.
func TestSynthWarnsWhenNoAlarmReachesAnyone(t *testing.T) {
	noEmail := awsStacks(t)
	if n := noSubscriberWarnings(noEmail); n != 1 {
		t.Errorf("%d no-subscriber warnings without alarmEmail, want 1", n)
	}
	if subs := noEmail.stateless.resources("AWS::SNS::Subscription"); len(subs) != 3 { // the consumers' queues only
		t.Errorf("%d subscriptions without alarmEmail, want the 3 consumer queues", len(subs))
	}
	withEmail := brokerStacks(t, "nats")
	if n := noSubscriberWarnings(withEmail); n != 0 {
		t.Errorf("%d no-subscriber warnings with alarmEmail, want 0", n)
	}
	var email bool
	for _, sub := range withEmail.stateless.resources("AWS::SNS::Subscription") {
		email = email || (sub.Props["Protocol"] == "email" && sub.Props["Endpoint"] == "ops@example.com")
	}
	if !email {
		t.Error("alarmEmail is not subscribed to the alarm topic")
	}
}

// TestBrokerNodeAlarms: the broker's memory and disk, per node (a Metrics
// Insights query over the Node dimension), before RabbitMQ's own memory and
// disk alarms block the publishers.
func TestBrokerNodeAlarms(t *testing.T) {
	th := stacks.DefaultThresholds()
	for variant, broker := range map[string]string{"rabbitmq": "Fifobox-broker", "rabbitmq-existing": "holdco-prod"} {
		tpl := brokerStacks(t, variant).stateless
		got := map[string]resource{}
		for _, a := range tpl.resources("AWS::CloudWatch::Alarm") {
			got[strings.TrimPrefix(a.Props["AlarmName"].(string), "Fifobox-")] = a
		}
		for name, w := range map[string]struct {
			metric, fn, cmp string
			threshold       float64
		}{
			// mq.m5.large: 8 GiB, RabbitMQ's limit about 40 % of it.
			stacks.AlarmBrokerMemory: {"RabbitMQMemUsed", "MAX", "GreaterThanThreshold", float64(int64(8 * (1 << 30) * 0.4 * th.BrokerMemoryPercent / 100))},
			stacks.AlarmBrokerDisk:   {"RabbitMQDiskFree", "MIN", "LessThanThreshold", float64(int64(200 * (1 << 30) * th.BrokerDiskFreePercent / 100))},
		} {
			a, ok := got[name]
			if !ok {
				t.Errorf("%s: alarm %s missing", variant, name)
				continue
			}
			q := list(a.Props["Metrics"])
			expr := ""
			if len(q) == 1 {
				expr = joinTemplate(dig(q[0], "Expression"))
			}
			if !strings.Contains(expr, "SELECT "+w.fn+"("+w.metric+`) FROM SCHEMA("AWS/AmazonMQ", Broker, Node)`) || !strings.Contains(expr, "Broker = '") ||
				(variant == "rabbitmq-existing" && !strings.Contains(expr, "'"+broker+"'")) {
				t.Errorf("%s: alarm %s query %q, want %s(%s) over the broker %s's nodes", variant, name, expr, w.fn, w.metric, broker)
			}
			if a.Props["ComparisonOperator"] != w.cmp || num(a.Props["Threshold"]) != w.threshold || a.Props["TreatMissingData"] != "breaching" {
				t.Errorf("%s: alarm %s %v %v missing %v, want %s %v breaching", variant, name, a.Props["ComparisonOperator"], a.Props["Threshold"], a.Props["TreatMissingData"], w.cmp, w.threshold)
			}
		}
	}
}

// TestEachFunctionHasItsOwnBrokerUser: the dispatcher, operations and each
// consumer read their own generated secret, the consumers' event sources
// log in as the consumer's user, and only the migration function (the
// provisioner) reads the administrator's secret, with every function's to
// create their users.
func TestEachFunctionHasItsOwnBrokerUser(t *testing.T) {
	for variant, admin := range map[string]string{"rabbitmq": "", "rabbitmq-existing": existingSecretArn} {
		t.Run(variant, func(t *testing.T) {
			s := brokerStacks(t, variant)
			tpl := s.stateless
			fns := fnsByEnv(tpl)
			secretOf := map[string]string{} // function -> its secret (logical id or ARN)
			for name, f := range fns {
				v := envOf(f)["FIFOBOX_AMQP_SECRET_ARN"]
				if id := refID(v); id != "" {
					secretOf[name] = id
				} else {
					secretOf[name] = joinTemplate(v)
				}
			}
			// Generated per-function secrets, named after the function.
			users := map[string]string{} // secret id -> username
			for _, sec := range tpl.resources("AWS::SecretsManager::Secret") {
				var u struct{ Username string }
				_ = json.Unmarshal([]byte(dig(sec.Props, "GenerateSecretString", "SecretStringTemplate").(string)), &u)
				users[sec.ID] = u.Username
			}
			seen := map[string]string{}
			for name, id := range secretOf {
				if name == "migration" {
					continue
				}
				key := name
				if name == "redrive" {
					key = "operations"
				}
				want := "fifobox-" + strings.ReplaceAll(key, ":", "-")
				if users[id] != want {
					t.Errorf("%s logs in as secret %s (user %q), want its own user %s", name, id, users[id], want)
				}
				if other, dup := seen[id]; dup {
					t.Errorf("%s and %s share secret %s", name, other, id)
				}
				seen[id] = name
			}
			// The migration function is the provisioner: the administrator's
			// secret, and every function's user to create.
			mig := envOf(fns["migration"])
			if admin != "" && secretOf["migration"] != admin {
				t.Errorf("migration logs in with %s, want the broker's administrator secret %s", secretOf["migration"], admin)
			}
			if _, generated := users[secretOf["migration"]]; generated {
				t.Errorf("migration logs in as a function's user %s", users[secretOf["migration"]])
			}
			if admin == "" && !strings.Contains(asJSON(mig["FIFOBOX_AMQP_SECRET_ARN"]), "BrokerSecret") {
				t.Errorf("migration's FIFOBOX_AMQP_SECRET_ARN %v is not the new broker's administrator secret", mig["FIFOBOX_AMQP_SECRET_ARN"])
			}
			userSecrets := joinTemplate(mig["FIFOBOX_AMQP_USER_SECRETS"])
			for name, id := range secretOf {
				key := name
				if name == "redrive" {
					key = "operations"
				}
				if name != "migration" && (!strings.Contains(userSecrets, `"`+key+`"`) || !strings.Contains(userSecrets, id)) {
					t.Errorf("FIFOBOX_AMQP_USER_SECRETS %s lacks %s's user (%s)", userSecrets, key, id)
				}
			}
			// Who may read which secret: each function its own; the
			// administrator's only the migration function.
			for name, f := range fns {
				var reads []string
				for _, st := range roleStatements(tpl, refID(f.Props["Role"])) {
					if strings.Contains(asJSON(st["Action"]), "secretsmanager:GetSecretValue") {
						reads = append(reads, asJSON(st["Resource"]))
					}
				}
				all := strings.Join(reads, " ")
				if name != "migration" {
					if !strings.Contains(all, secretOf[name]) {
						t.Errorf("%s cannot read its own secret %s: %v", name, secretOf[name], reads)
					}
					for id, other := range seen {
						if other != name && strings.Contains(all, id) {
							t.Errorf("%s can read %s's secret %s", name, other, id)
						}
					}
					if (admin != "" && strings.Contains(all, admin)) || strings.Contains(all, "BrokerSecret") {
						t.Errorf("%s can read the administrator's secret: %v", name, reads)
					}
				}
			}
			// The event source reads the queue as the consumer's user.
			for _, m := range tpl.resources("AWS::Lambda::EventSourceMapping") {
				fn := tpl.resource(refID(m.Props["FunctionName"]))
				name := "consumer:" + envOf(fn)["FIFOBOX_CONSUMER_NAME"].(string)
				for _, a := range list(m.Props["SourceAccessConfigurations"]) {
					if dig(a, "Type") == "BASIC_AUTH" && refID(dig(a, "URI")) != secretOf[name] {
						t.Errorf("%s's event source logs in with %v, want its function's secret %s", name, dig(a, "URI"), secretOf[name])
					}
				}
			}
		})
	}
}
