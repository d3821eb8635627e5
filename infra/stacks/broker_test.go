package stacks_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/assertions"
	"github.com/aws/jsii-runtime-go"

	"github.com/fifobox/fifobox/infra/stacks"
)

// The broker variants (context transport=rabbitmq / nats), each synthesised
// once with cdk-nag applied, like the SNS pair.
const (
	existingBrokerArn = "arn:aws:mq:eu-west-1:123456789012:broker:holdco-prod:b-1234abcd-56ef-78ab-90cd-ef1234567890"
	existingSecretArn = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:holdco/mq-AbCdEf"
	natsSecretArn     = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:billing/nats-AbCdEf"
	// natsDispatcherSecretArn is the dispatcher's own NATS user.
	natsDispatcherSecretArn = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:billing/nats-dispatcher-AbCdEf"
)

func brokerConfig(variant string) stacks.Config {
	cfg := testConfig()
	switch variant {
	case "rabbitmq":
		cfg.Transport = stacks.TransportRabbitMQ
		cfg.AMQP.TopologyFile = "../../topologies/rabbitmq/ticketing.json"
	case "rabbitmq-existing":
		cfg.Transport = stacks.TransportRabbitMQ
		cfg.AMQP.TopologyFile = "../../topologies/rabbitmq/holdco.json"
		cfg.AMQP.VirtualHost = "holdco"
		cfg.AMQP.BrokerArn = existingBrokerArn
		cfg.AMQP.Endpoint = "amqps://b-1234abcd.mq.eu-west-1.amazonaws.com:5671"
		cfg.AMQP.SecretArn = existingSecretArn
		cfg.AMQP.SecurityGroupID = "sg-0123456789abcdef0"
	case "nats":
		cfg.Transport = stacks.TransportNATS
		cfg.NATS.TopologyFile = "../../topologies/nats/holdco.json"
		cfg.NATS.URL = "tls://nats-1.billing.internal:4222,tls://nats-2.billing.internal:4222"
		cfg.NATS.SecretArn = natsSecretArn
		cfg.NATS.CIDR = "10.20.0.0/16"
		cfg.AlarmEmail = "ops@example.com" // the one variant with a subscriber
		cfg.NATS.SecretArns = map[string]string{stacks.BrokerUserDispatcher: natsDispatcherSecretArn}
	default:
		panic(variant)
	}
	return cfg
}

type variantSynth struct {
	once sync.Once
	s    synthesised
	err  error
}

var brokerSynths = map[string]*variantSynth{"rabbitmq": {}, "rabbitmq-existing": {}, "nats": {}}

func brokerStacks(t *testing.T, variant string) *synthesised {
	t.Helper()
	v := brokerSynths[variant]
	v.once.Do(func() {
		defer func() {
			if r := recover(); r != nil {
				v.err = synthFailure(r)
			}
		}()
		s, err := stacks.Build(newApp(t), brokerConfig(variant), false, nil)
		if err != nil {
			v.err = err
			return
		}
		v.s.stateful = toTemplate(s.Stateful.Stack)
		v.s.stateless = toTemplate(s.Stateless.Stack)
		v.s.statelessStack = s.Stateless
		for _, st := range []awscdk.Stack{s.Stateful.Stack, s.Stateless.Stack} {
			ann := assertions.Annotations_FromStack(st)
			match := assertions.Match_StringLikeRegexp(jsii.String("AwsSolutions-.*|CdkNagValidationFailure.*"))
			for _, m := range *ann.FindError(jsii.String("*"), match) {
				v.s.nagErrors = append(v.s.nagErrors, fmt.Sprintf("%s: %v", *m.Id, m.Entry.Data))
			}
			for _, m := range *ann.FindWarning(jsii.String("*"), match) {
				v.s.nagWarnings = append(v.s.nagWarnings, fmt.Sprintf("%s: %v", *m.Id, m.Entry.Data))
			}
		}
	})
	if v.err != nil {
		t.Fatalf("%s: %v", variant, v.err)
	}
	return &v.s
}

// fnsByEnv maps the functions of a template by role, for any transport,
// recognised by their environment: migration (the database secret),
// redrive (a default operation), consumer:<name>, and dispatcher (metrics
// without a consumer name).
func fnsByEnv(tpl template) map[string]resource {
	out := map[string]resource{}
	for _, f := range tpl.resources("AWS::Lambda::Function") {
		env, _ := dig(f.Props, "Environment", "Variables").(map[string]any)
		switch {
		case env["FIFOBOX_DB_SECRET_ARN"] != nil:
			out["migration"] = f
		case env["FIFOBOX_DEFAULT_OPERATION"] != nil:
			out["redrive"] = f
		case env["FIFOBOX_CONSUMER_NAME"] != nil:
			out["consumer:"+env["FIFOBOX_CONSUMER_NAME"].(string)] = f
		case env["FIFOBOX_METRICS_NAMESPACE"] != nil:
			out["dispatcher"] = f
		}
	}
	return out
}

func envOf(f resource) map[string]any {
	env, _ := dig(f.Props, "Environment", "Variables").(map[string]any)
	return env
}

func TestBrokerVariantsPassCdkNag(t *testing.T) {
	for variant := range brokerSynths {
		t.Run(variant, func(t *testing.T) {
			s := brokerStacks(t, variant)
			for _, e := range s.nagErrors {
				t.Errorf("cdk-nag error: %s", e)
			}
			for _, w := range s.nagWarnings {
				t.Errorf("cdk-nag warning: %s", w)
			}
		})
	}
}

// A broker deployment has no SNS FIFO topic, no SQS FIFO queue and no
// SNS/SQS endpoint: the dispatcher publishes to the broker and nothing
// calls SNS or SQS (the alarm topic and the schedule's DLQ stay).
func TestBrokerVariantsHaveNoSNSOrSQSPipeline(t *testing.T) {
	for variant := range brokerSynths {
		t.Run(variant, func(t *testing.T) {
			s := brokerStacks(t, variant)
			for _, tp := range s.stateless.resources("AWS::SNS::Topic") {
				if tp.Props["FifoTopic"] == true {
					t.Errorf("FIFO topic %s", tp.ID)
				}
			}
			for _, q := range s.stateless.resources("AWS::SQS::Queue") {
				if q.Props["FifoQueue"] == true {
					t.Errorf("FIFO queue %s", q.ID)
				}
			}
			for _, ep := range s.stateful.resources("AWS::EC2::VPCEndpoint") {
				name := joinTemplate(ep.Props["ServiceName"])
				if strings.HasSuffix(name, ".sns") || strings.HasSuffix(name, ".sqs") {
					t.Errorf("endpoint %s for %s", ep.ID, name)
				}
			}
			for _, p := range s.stateless.resources("AWS::IAM::Policy") {
				b, _ := json.Marshal(p.Props)
				if strings.Contains(string(b), "sns:Publish") || strings.Contains(string(b), "sqs:ReceiveMessage") {
					t.Errorf("policy %s may publish to SNS or receive from SQS", p.ID)
				}
			}
			fns := fnsByEnv(s.stateless)
			for name, f := range fns {
				env := envOf(f)
				for _, k := range []string{"FIFOBOX_TOPIC_ARN", "FIFOBOX_QUEUES", "FIFOBOX_DLQ_URL"} {
					if env[k] != nil {
						t.Errorf("%s has %s", name, k)
					}
				}
				if env["FIFOBOX_TRANSPORT"] == nil {
					t.Errorf("%s has no FIFOBOX_TRANSPORT", name)
				}
			}
		})
	}
}

func TestRabbitMQBroker(t *testing.T) {
	s := brokerStacks(t, "rabbitmq")
	brokers := s.stateful.resources("AWS::AmazonMQ::Broker")
	if len(brokers) != 1 {
		t.Fatalf("%d brokers, want 1", len(brokers))
	}
	b := brokers[0].Props
	for k, want := range map[string]any{
		"EngineType": "RABBITMQ", "EngineVersion": "3.13", "DeploymentMode": "CLUSTER_MULTI_AZ",
		"PubliclyAccessible": false, "AutoMinorVersionUpgrade": true, "BrokerName": "Fifobox-broker",
	} {
		if b[k] != want {
			t.Errorf("broker %s = %v, want %v", k, b[k], want)
		}
	}
	if dig(b, "Logs", "General") != true {
		t.Errorf("broker general logs off: %v", b["Logs"])
	}
	if n := len(list(b["SubnetIds"])); n != 2 {
		t.Errorf("cluster broker in %d subnets, want the 2 isolated ones", n)
	}
	// The password is a dynamic reference to the generated secret, never a literal.
	users := list(b["Users"])
	if len(users) != 1 || !strings.Contains(joinTemplate(dig(users[0], "Password")), "{{resolve:secretsmanager:") {
		t.Errorf("broker users: %v", users)
	}
	var secretOK bool
	for _, sec := range s.stateful.resources("AWS::SecretsManager::Secret") {
		gen := dig(sec.Props, "GenerateSecretString")
		if dig(gen, "SecretStringTemplate") == `{"username":"fifobox"}` && dig(gen, "GenerateStringKey") == "password" && dig(gen, "ExcludePunctuation") == true {
			secretOK = true
		}
	}
	if !secretOK {
		t.Errorf("no generated broker secret {username, password} without punctuation")
	}

	// The broker's group admits AMQPS from the functions and from itself
	// (the event source pollers), and nothing else.
	sgID := refID(list(b["SecurityGroups"])[0])
	var fromFns, fromSelf bool
	for _, in := range s.stateful.resources("AWS::EC2::SecurityGroupIngress") {
		if refID(in.Props["GroupId"]) != sgID {
			continue
		}
		if num(in.Props["FromPort"]) != stacks.AMQPPort || num(in.Props["ToPort"]) != stacks.AMQPPort {
			t.Errorf("broker ingress %s on %v-%v", in.ID, in.Props["FromPort"], in.Props["ToPort"])
		}
		switch refID(in.Props["SourceSecurityGroupId"]) {
		case sgID:
			fromSelf = true
		case "":
			t.Errorf("broker ingress %s from a CIDR", in.ID)
		default:
			fromFns = true
		}
	}
	if !fromFns || !fromSelf {
		t.Errorf("broker ingress from functions %v, from itself %v", fromFns, fromSelf)
	}
	var lambdaEndpoint bool
	for _, ep := range s.stateful.resources("AWS::EC2::VPCEndpoint") {
		lambdaEndpoint = lambdaEndpoint || strings.HasSuffix(joinTemplate(ep.Props["ServiceName"]), ".lambda")
	}
	if !lambdaEndpoint {
		t.Errorf("no Lambda interface endpoint: the event source pollers in the isolated subnets need one")
	}
}

func TestRabbitMQConsumersOnTheBrokersEventSource(t *testing.T) {
	for variant, want := range map[string]struct {
		queues []string
		vhost  string
		arn    string
	}{
		"rabbitmq":          {[]string{"ticketing.inventory", "ticketing.notification"}, "/", ""},
		"rabbitmq-existing": {[]string{"analytics.ingest", "erp.sync", "notifications"}, "holdco", existingBrokerArn},
	} {
		t.Run(variant, func(t *testing.T) {
			s := brokerStacks(t, variant)
			tpl := s.stateless
			fns := fnsByEnv(tpl)
			maps := tpl.resources("AWS::Lambda::EventSourceMapping")
			if len(maps) != len(want.queues) {
				t.Fatalf("%d event source mappings, want %d", len(maps), len(want.queues))
			}
			got := map[string]bool{}
			for _, m := range maps {
				q := list(m.Props["Queues"])
				if len(q) != 1 {
					t.Fatalf("%s queues %v", m.ID, q)
				}
				got[q[0].(string)] = true
				if want.arn != "" && m.Props["EventSourceArn"] != want.arn {
					t.Errorf("%s event source %v, want %s", m.ID, m.Props["EventSourceArn"], want.arn)
				}
				access := map[string]any{}
				for _, a := range list(m.Props["SourceAccessConfigurations"]) {
					access[dig(a, "Type").(string)] = dig(a, "URI")
				}
				if access["VIRTUAL_HOST"] != want.vhost || access["BASIC_AUTH"] == nil {
					t.Errorf("%s access %v", m.ID, access)
				}
				fn := tpl.resource(refID(m.Props["FunctionName"]))
				env := envOf(fn)
				if env["FIFOBOX_TRANSPORT"] != "rabbitmq" || env["FIFOBOX_AMQP_SECRET_ARN"] == nil || env["FIFOBOX_AMQP_TOPOLOGY"] == nil {
					t.Errorf("%s's function env %v", m.ID, env)
				}
				// It starts after migrate declared the queues and after its
				// role may read the secret and describe the broker.
				deps := dependsOn(tpl, m.ID)
				if !deps["Migrate"] {
					t.Errorf("%s does not wait for the migration trigger: %v", m.ID, deps)
				}
				var policy bool
				for d := range deps {
					policy = policy || tpl.resource(d).Type == "AWS::IAM::Policy"
				}
				if !policy {
					t.Errorf("%s does not wait for its role's policy: %v", m.ID, deps)
				}
			}
			for _, q := range want.queues {
				if !got[q] {
					t.Errorf("no event source on queue %s (got %v)", q, keys(got))
				}
			}
			if len(fns) != 3+len(want.queues) { // dispatcher, redrive, migration
				t.Errorf("functions %v", keys(fns))
			}
			// The URL carries the virtual host, never credentials.
			url := joinTemplate(envOf(fns["dispatcher"])["FIFOBOX_AMQP_URL"])
			if strings.Contains(url, "@") || (want.vhost != "/" && !strings.HasSuffix(url, "/"+want.vhost)) {
				t.Errorf("FIFOBOX_AMQP_URL %q", url)
			}
			// Secret reads for every function; mq:DescribeBroker for consumers.
			for name, f := range fns {
				role := refID(f.Props["Role"])
				var read, describe bool
				for _, st := range roleStatements(tpl, role) {
					acts := fmt.Sprint(st["Action"])
					read = read || strings.Contains(acts, "secretsmanager:GetSecretValue")
					describe = describe || strings.Contains(acts, "mq:DescribeBroker")
				}
				if !read {
					t.Errorf("%s cannot read the broker secret", name)
				}
				if strings.HasPrefix(name, "consumer:") != describe {
					t.Errorf("%s: mq:DescribeBroker %v", name, describe)
				}
			}
		})
	}
}

func dependsOn(tpl template, id string) map[string]bool {
	r, _ := tpl["Resources"].(map[string]any)[id].(map[string]any)
	out := map[string]bool{}
	deps, _ := r["DependsOn"].([]any)
	for _, d := range deps {
		out[d.(string)] = true
	}
	return out
}

// roleStatements are the statements of the IAM policies attached to role.
func roleStatements(tpl template, role string) []map[string]any {
	var out []map[string]any
	for _, p := range tpl.resources("AWS::IAM::Policy") {
		roles, _ := p.Props["Roles"].([]any)
		for _, r := range roles {
			if refID(r) == role {
				sts, _ := dig(p.Props, "PolicyDocument", "Statement").([]any)
				for _, st := range sts {
					out = append(out, st.(map[string]any))
				}
			}
		}
	}
	return out
}

func TestRabbitMQAlarms(t *testing.T) {
	for variant, want := range map[string]struct{ broker, vhost string }{
		"rabbitmq":          {"Fifobox-broker", "/"},
		"rabbitmq-existing": {"holdco-prod", "holdco"},
	} {
		t.Run(variant, func(t *testing.T) {
			tpl := brokerStacks(t, variant).stateless
			alarms := map[string]resource{}
			for _, a := range tpl.resources("AWS::CloudWatch::Alarm") {
				alarms[a.Props["AlarmName"].(string)] = a
			}
			for _, name := range []string{stacks.AlarmPublishLag, stacks.AlarmDeadEvents, stacks.AlarmDispatcherErrors} {
				if _, ok := alarms["Fifobox-"+name]; !ok {
					t.Errorf("no %s alarm", name)
				}
			}
			if _, ok := alarms["Fifobox-"+stacks.AlarmDeliveryFailed]; ok {
				t.Errorf("an SNS delivery alarm on a RabbitMQ deployment")
			}
			var dlqs, backlogs int
			for name, a := range alarms {
				if a.Props["Namespace"] != "AWS/AmazonMQ" {
					continue
				}
				dims := map[string]any{}
				for _, d := range list(a.Props["Dimensions"]) {
					dims[dig(d, "Name").(string)] = dig(d, "Value")
				}
				if dims["Broker"] != want.broker || dims["VirtualHost"] != want.vhost {
					t.Errorf("%s dimensions %v", name, dims)
				}
				switch {
				case strings.Contains(name, stacks.AlarmDLQMessages) && a.Props["MetricName"] == "MessageCount" && strings.HasSuffix(dims["Queue"].(string), ".dlq"):
					dlqs++
				case strings.Contains(name, stacks.AlarmBrokerQueue) && a.Props["MetricName"] == "MessageReadyCount":
					backlogs++
				default:
					t.Errorf("unexpected broker alarm %s on %v", name, a.Props["MetricName"])
				}
			}
			n := len(tpl.resources("AWS::Lambda::EventSourceMapping"))
			if dlqs != n || backlogs != n {
				t.Errorf("%d DLQ and %d backlog alarms, want %d each", dlqs, backlogs, n)
			}
		})
	}
}

func TestExistingBrokerIsNotCreated(t *testing.T) {
	s := brokerStacks(t, "rabbitmq-existing")
	if n := len(s.stateful.resources("AWS::AmazonMQ::Broker")); n != 0 {
		t.Errorf("%d brokers created with amqpBrokerArn set", n)
	}
	var opened bool
	for _, in := range s.stateful.resources("AWS::EC2::SecurityGroupIngress") {
		opened = opened || (in.Props["GroupId"] == "sg-0123456789abcdef0" && num(in.Props["FromPort"]) == stacks.AMQPPort)
	}
	if !opened {
		t.Errorf("the existing broker's security group is not opened to the functions on %d", stacks.AMQPPort)
	}
	// The existing broker's (administrator) secret is the provisioner's
	// alone; every other function logs in as its own user.
	for name, f := range fnsByEnv(s.stateless) {
		if v := envOf(f)["FIFOBOX_AMQP_SECRET_ARN"]; (v == existingSecretArn) != (name == "migration") {
			t.Errorf("%s FIFOBOX_AMQP_SECRET_ARN = %v", name, v)
		}
	}
}

func TestNATSVariant(t *testing.T) {
	s := brokerStacks(t, "nats")
	fns := fnsByEnv(s.stateless)
	if len(fns) != 3 || fns["dispatcher"].ID == "" || fns["redrive"].ID == "" || fns["migration"].ID == "" {
		t.Fatalf("functions %v, want dispatcher, redrive and migration only (no NATS event source for Lambda)", keys(fns))
	}
	if n := len(s.stateless.resources("AWS::Lambda::EventSourceMapping")); n != 0 {
		t.Errorf("%d event source mappings", n)
	}
	for name, f := range fns {
		env := envOf(f)
		// The dispatcher has a user of its own (natsDispatcherSecretArn);
		// the others share natsSecretArn.
		secret := natsSecretArn
		if name == "dispatcher" {
			secret = natsDispatcherSecretArn
		}
		if env["FIFOBOX_TRANSPORT"] != "nats" || env["FIFOBOX_NATS_URL"] != brokerConfig("nats").NATS.URL ||
			env["FIFOBOX_NATS_SECRET_ARN"] != secret || !strings.HasPrefix(fmt.Sprint(env["FIFOBOX_NATS_TOPOLOGY"]), "{") {
			t.Errorf("%s env %v", name, env)
		}
		var reads []string
		for _, st := range roleStatements(s.stateless, refID(f.Props["Role"])) {
			if strings.Contains(asJSON(st["Action"]), "secretsmanager:GetSecretValue") {
				reads = append(reads, asJSON(st["Resource"]))
			}
		}
		if all := strings.Join(reads, " "); !strings.Contains(all, secret) || (name != "dispatcher" && strings.Contains(all, natsDispatcherSecretArn)) {
			t.Errorf("%s reads secrets %v, want its own %s only", name, reads, secret)
		}
	}
	var egress bool
	for _, e := range s.stateful.resources("AWS::EC2::SecurityGroupEgress") {
		egress = egress || (e.Props["CidrIp"] == "10.20.0.0/16" && num(e.Props["FromPort"]) == 4222)
	}
	for _, g := range s.stateful.resources("AWS::EC2::SecurityGroup") {
		for _, e := range list(g.Props["SecurityGroupEgress"]) {
			egress = egress || (dig(e, "CidrIp") == "10.20.0.0/16" && num(dig(e, "FromPort")) == 4222)
		}
	}
	if !egress {
		t.Errorf("the functions may not reach NATS at 10.20.0.0/16:4222")
	}
	if n := len(s.stateful.resources("AWS::AmazonMQ::Broker")); n != 0 {
		t.Errorf("a NATS deployment creates %d Amazon MQ brokers", n)
	}
}

func TestTransportConfigValidation(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big.json")
	var consumers []string
	for i := 0; i < 80; i++ {
		consumers = append(consumers, fmt.Sprintf(`{"name":"consumer-%02d","queue":"a-rather-long-queue-name-%02d"}`, i, i))
	}
	if err := os.WriteFile(big, []byte(`{"exchange":{"name":"x","kind":"fanout"},"consumers":[`+strings.Join(consumers, ",")+`]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.json")
	if err := os.WriteFile(empty, []byte(`{"exchange":{"name":"x","kind":"fanout"},"consumers":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		edit  func(*stacks.Config)
		field string
	}{
		{"unknown transport", func(c *stacks.Config) { c.Transport = "kafka" }, "transport"},
		{"rabbitmq without topology", func(c *stacks.Config) { c.Transport = "rabbitmq"; c.AMQP.TopologyFile = "" }, "amqpTopology"},
		{"rabbitmq topology missing", func(c *stacks.Config) {
			c.Transport = "rabbitmq"
			c.AMQP.TopologyFile = filepath.Join(dir, "nope.json")
		}, "amqpTopology"},
		{"rabbitmq topology too big", func(c *stacks.Config) { c.Transport = "rabbitmq"; c.AMQP.TopologyFile = big }, "4 KB"},
		{"rabbitmq topology without consumers", func(c *stacks.Config) { c.Transport = "rabbitmq"; c.AMQP.TopologyFile = empty }, "no consumers"},
		{"half an existing broker", func(c *stacks.Config) {
			*c = brokerConfig("rabbitmq-existing")
			c.AMQP.SecretArn = ""
		}, "amqpSecretArn"},
		{"existing broker URL with credentials", func(c *stacks.Config) {
			*c = brokerConfig("rabbitmq-existing")
			c.AMQP.Endpoint = "amqps://admin:secret@b-1.mq.eu-west-1.amazonaws.com:5671"
		}, "amqpEndpoint"},
		{"existing broker ARN", func(c *stacks.Config) {
			*c = brokerConfig("rabbitmq-existing")
			c.AMQP.BrokerArn = "holdco-prod"
		}, "amqpBrokerArn"},
		{"deployment mode", func(c *stacks.Config) {
			*c = brokerConfig("rabbitmq")
			c.AMQP.DeploymentMode = "ACTIVE_STANDBY_MULTI_AZ"
		}, "amqpDeploymentMode"},
		{"nats without url", func(c *stacks.Config) { *c = brokerConfig("nats"); c.NATS.URL = "" }, "natsUrl"},
		{"nats url with credentials", func(c *stacks.Config) { *c = brokerConfig("nats"); c.NATS.URL = "nats://user:pw@nats:4222" }, "natsUrl"},
		{"nats url scheme", func(c *stacks.Config) { *c = brokerConfig("nats"); c.NATS.URL = "http://nats:4222" }, "natsUrl"},
		{"nats port", func(c *stacks.Config) { *c = brokerConfig("nats"); c.NATS.Port = 0 }, "natsPort"},
		{"nats without topology", func(c *stacks.Config) { *c = brokerConfig("nats"); c.NATS.TopologyFile = "" }, "natsTopology"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := testConfig()
			c.edit(&cfg)
			err := cfg.Validate()
			if err == nil || !strings.Contains(err.Error(), c.field) {
				t.Errorf("err = %v, want one naming %s", err, c.field)
			}
		})
	}
	for _, v := range []string{"rabbitmq", "rabbitmq-existing", "nats"} {
		if err := brokerConfig(v).Validate(); err != nil {
			t.Errorf("%s: %v", v, err)
		}
	}
	// The emulator variant is SNS/SQS only.
	if _, err := stacks.Build(newApp(t), brokerConfig("rabbitmq"), true, nil); err == nil || !strings.Contains(err.Error(), "make local") {
		t.Errorf("local variant with transport=rabbitmq: err = %v", err)
	}
}
