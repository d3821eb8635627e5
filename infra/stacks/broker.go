package stacks

import (
	"net/url"
	"strings"

	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsamazonmq"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsec2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsiam"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslambda"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssecretsmanager"
	"github.com/aws/jsii-runtime-go"
	"github.com/cdklabs/cdk-nag-go/cdknag/v2"
)

// AMQPBroker is the Amazon MQ for RabbitMQ broker of a rabbitmq deployment:
// one fifobox created (Resource set) or an existing one (context amqp*).
type AMQPBroker struct {
	// Arn is the broker's ARN, the consumer event sources' EventSourceArn.
	Arn *string
	// Name is the broker's name: the Broker dimension of its metrics.
	Name *string
	// Endpoint is amqps://<host>:5671, without credentials or virtual host.
	Endpoint *string
	// Secret holds {"username", "password"}: the functions' credentials and
	// the event sources' BASIC_AUTH.
	Secret awssecretsmanager.ISecret
	// SecurityGroup is the broker's group (nil for an existing broker
	// without amqpSecurityGroupId).
	SecurityGroup awsec2.ISecurityGroup
	// Resource is nil for an existing broker.
	Resource awsamazonmq.CfnBroker
}

// URL is the functions' FIFOBOX_AMQP_URL: the endpoint and the virtual host.
func (b *AMQPBroker) URL(vhost string) *string {
	if vhost == "/" {
		return b.Endpoint
	}
	return awscdk.Fn_Join(jsii.String(""), jsii.Strings(*b.Endpoint, "/"+url.PathEscape(vhost)))
}

// newAMQPBroker creates the broker (private, in the functions' subnets, its
// user's password generated into Secrets Manager, general logs on, minor
// versions upgraded in the maintenance window) or imports an existing one,
// and lets the functions reach it on 5671. endpoints are the interface
// endpoints Lambda's event source pollers need from the broker's subnets
// (they run with the broker's security group).
func newAMQPBroker(stack awscdk.Stack, s *StatefulStack, cfg Config, endpoints []awsec2.IInterfaceVpcEndpoint) *AMQPBroker {
	a := cfg.AMQP
	port := awsec2.Port_Tcp(jsii.Number(AMQPPort))
	if a.Existing() {
		b := &AMQPBroker{
			Arn: jsii.String(a.BrokerArn),
			// arn:aws:mq:<region>:<account>:broker:<name>:<id>
			Name:     jsii.String(strings.Split(a.BrokerArn, ":")[6]),
			Endpoint: jsii.String(strings.TrimSuffix(a.Endpoint, "/")),
			Secret:   awssecretsmanager.Secret_FromSecretCompleteArn(stack, jsii.String("BrokerSecret"), jsii.String(a.SecretArn)),
		}
		if a.SecurityGroupID != "" {
			b.SecurityGroup = awsec2.SecurityGroup_FromSecurityGroupId(stack, jsii.String("BrokerSecurityGroup"), jsii.String(a.SecurityGroupID),
				&awsec2.SecurityGroupImportOptions{Mutable: jsii.Bool(true)})
			b.SecurityGroup.Connections().AllowFrom(s.FunctionSG, port, jsii.String("fifobox functions to the RabbitMQ broker (AMQPS)"))
		} else {
			s.FunctionSG.AddEgressRule(awsec2.Peer_Ipv4(s.Vpc.VpcCidrBlock()), port, jsii.String("AMQPS to the existing RabbitMQ broker in the VPC"), nil)
		}
		return b
	}

	sg := awsec2.NewSecurityGroup(stack, jsii.String("BrokerSecurityGroup"), &awsec2.SecurityGroupProps{
		Vpc:              s.Vpc,
		Description:      jsii.String("fifobox RabbitMQ broker: AMQPS from the functions and from the Lambda event source pollers"),
		AllowAllOutbound: jsii.Bool(false),
	})
	sg.Connections().AllowFrom(s.FunctionSG, port, jsii.String("fifobox functions to the RabbitMQ broker (AMQPS)"))
	// Lambda's Amazon MQ pollers run in the broker's subnets with the
	// broker's security group: they reach the broker through it, and the
	// Lambda and Secrets Manager endpoints from it.
	sg.Connections().AllowInternally(port, jsii.String("Lambda's event source pollers (broker security group) to the broker"))
	if len(endpoints) > 0 {
		for _, ep := range endpoints {
			ep.Connections().AllowDefaultPortFrom(sg, jsii.String("Lambda's RabbitMQ event source pollers"))
		}
	} else {
		sg.AddEgressRule(awsec2.Peer_Ipv4(s.Vpc.VpcCidrBlock()), awsec2.Port_Tcp(jsii.Number(443)),
			jsii.String("HTTPS to the VPC interface endpoints (Lambda, Secrets Manager) for the event source pollers"), nil)
	}

	// Letters and digits only: Amazon MQ refuses , : = in passwords, and the
	// functions put it in an AMQP URL.
	secret := awssecretsmanager.NewSecret(stack, jsii.String("BrokerSecret"), &awssecretsmanager.SecretProps{
		Description: jsii.String("fifobox: the RabbitMQ broker's user (username, password) for the functions and Lambda's event sources"),
		GenerateSecretString: &awssecretsmanager.SecretStringGenerator{
			SecretStringTemplate: jsii.String(`{"username":"` + a.Username + `"}`),
			GenerateStringKey:    jsii.String("password"),
			PasswordLength:       jsii.Number(32),
			ExcludePunctuation:   jsii.Bool(true),
		},
		RemovalPolicy: awscdk.RemovalPolicy_RETAIN,
	})
	cdknag.NagSuppressions_AddResourceSuppressions(secret, &[]*cdknag.NagPackSuppression{{
		Id:     jsii.String("AwsSolutions-SMG4"),
		Reason: jsii.String("Secrets Manager has no rotation function for Amazon MQ for RabbitMQ users (the broker's users change through the RabbitMQ management API, not CloudFormation); docs/deploying.md describes rotating the password by hand."),
	}}, nil)

	subnets := s.Vpc.SelectSubnets(s.Subnets).SubnetIds
	if a.DeploymentMode == "SINGLE_INSTANCE" {
		subnets = &[]*string{(*subnets)[0]}
	}
	name := cfg.Prefix + "-broker"
	broker := awsamazonmq.NewCfnBroker(stack, jsii.String("Broker"), &awsamazonmq.CfnBrokerProps{
		BrokerName:       jsii.String(name),
		EngineType:       jsii.String("RABBITMQ"),
		EngineVersion:    jsii.String(a.EngineVersion),
		HostInstanceType: jsii.String(a.InstanceType),
		// Three nodes across AZs: quorum queues replicate every message.
		DeploymentMode:          jsii.String(a.DeploymentMode),
		PubliclyAccessible:      jsii.Bool(false),
		AutoMinorVersionUpgrade: jsii.Bool(true),
		SubnetIds:               subnets,
		SecurityGroups:          &[]*string{sg.SecurityGroupId()},
		Users: []any{&awsamazonmq.CfnBroker_UserProperty{
			Username: jsii.String(a.Username),
			Password: secret.SecretValueFromJson(jsii.String("password")).UnsafeUnwrap(),
		}},
		Logs: &awsamazonmq.CfnBroker_LogListProperty{General: jsii.Bool(true)},
		// Amazon MQ for RabbitMQ encrypts at rest with an AWS-owned key only.
		EncryptionOptions: &awsamazonmq.CfnBroker_EncryptionOptionsProperty{UseAwsOwnedKey: jsii.Bool(true)},
		MaintenanceWindowStartTime: &awsamazonmq.CfnBroker_MaintenanceWindowProperty{
			DayOfWeek: jsii.String("SUNDAY"), TimeOfDay: jsii.String("03:00"), TimeZone: jsii.String("UTC"),
		},
	})
	// Messages not yet consumed live there: a stack deletion keeps it.
	broker.ApplyRemovalPolicy(awscdk.RemovalPolicy_RETAIN, nil)
	awscdk.NewCfnOutput(stack, jsii.String("BrokerArn"), &awscdk.CfnOutputProps{Value: broker.AttrArn()})
	return &AMQPBroker{
		Arn:           broker.AttrArn(),
		Name:          jsii.String(name),
		Endpoint:      awscdk.Fn_Select(jsii.Number(0), broker.AttrAmqpEndpoints()),
		Secret:        secret,
		SecurityGroup: sg,
		Resource:      broker,
	}
}

// allowNATS lets the functions reach the NATS cluster (natsCidr, default the
// VPC's range, on natsPort).
func allowNATS(s *StatefulStack, cfg Config) {
	peer := awsec2.Peer_Ipv4(s.Vpc.VpcCidrBlock())
	if cfg.NATS.CIDR != "" {
		peer = awsec2.Peer_Ipv4(jsii.String(cfg.NATS.CIDR))
	}
	s.FunctionSG.AddEgressRule(peer, awsec2.Port_Tcp(jsii.Number(cfg.NATS.Port)), jsii.String("fifobox functions to the NATS cluster"), nil)
}

// BrokerConsumerTimeoutSeconds is a RabbitMQ consumer function's timeout.
// Lambda runs one invocation per event source at a time for RabbitMQ, so a
// batch's time bounds the queue's progress, not its parallelism.
const BrokerConsumerTimeoutSeconds = 60

// BrokerConsumerBatchSize is the event sources' batch size: the handler
// applies each record in its own inbox transaction and settles a bad one
// itself (retry queue or DLQ), so a large batch costs no re-applies.
const BrokerConsumerBatchSize = 100

// transportName describes where the dispatcher publishes.
func transportName(cfg Config) string {
	switch cfg.Transport {
	case TransportRabbitMQ:
		return "RabbitMQ (Amazon MQ)"
	case TransportNATS:
		return "NATS JetStream"
	}
	return "SNS FIFO"
}

// Broker user keys: each function of a broker deployment logs in as its own
// broker user (pkg/transport/amqp's roles), read from its own secret. The
// provisioner (the migration function) alone has the administrator's.
const (
	BrokerUserDispatcher  = "dispatcher"
	BrokerUserOperations  = "operations"
	BrokerUserProvisioner = "provisioner"
)

// BrokerUserConsumer is consumer name's broker user key.
func BrokerUserConsumer(name string) string { return "consumer:" + name }

// BrokerUsername is the broker user name of key: "<amqpUsername>-dispatcher",
// "-operations", "-consumer-<name>" (the administrator's for the provisioner).
func BrokerUsername(cfg Config, key string) string {
	if key == BrokerUserProvisioner {
		return cfg.AMQP.Username
	}
	return cfg.AMQP.Username + "-" + strings.ReplaceAll(key, ":", "-")
}

// brokerAccess is what each function of a broker deployment gets: the
// environment transport.Open reads (amqp.OpenEnv, nats.OpenEnv) (the transport, its URL without
// credentials, the topology's JSON, the ARN of that function's own secret)
// and read access to that secret alone. Empty for SNS.
type brokerAccess struct {
	common  map[string]*string
	secrets map[string]awssecretsmanager.ISecret // by broker user key (RabbitMQ); "" for all (NATS)
	// users maps the functions' keys to their secrets' ARNs: the
	// provisioner's FIFOBOX_AMQP_USER_SECRETS.
	users map[string]any
	top   LoadedTopology
}

// newBrokerAccess creates, for RabbitMQ, one generated secret per function
// (dispatcher, operations, each consumer), whose user the deploy's migrate
// creates on the broker with that function's permissions; for NATS, the one
// configured secret (natsSecretArn) serves every function.
func newBrokerAccess(stack awscdk.Stack, cfg Config, net *Network) *brokerAccess {
	a := &brokerAccess{secrets: map[string]awssecretsmanager.ISecret{}, users: map[string]any{}}
	switch cfg.Transport {
	case TransportRabbitMQ:
		a.top, _ = LoadTopologyFile("amqpTopology", cfg.AMQP.TopologyFile) // checked by Validate
		b := net.Broker
		a.common = map[string]*string{
			"FIFOBOX_TRANSPORT":     jsii.String(TransportRabbitMQ),
			"FIFOBOX_AMQP_URL":      b.URL(cfg.AMQP.VirtualHost),
			"FIFOBOX_AMQP_TOPOLOGY": jsii.String(a.top.JSON),
		}
		a.secrets[BrokerUserProvisioner] = b.Secret
		keys := []string{BrokerUserDispatcher, BrokerUserOperations}
		for _, c := range a.top.Consumers {
			keys = append(keys, BrokerUserConsumer(c.Name))
		}
		for _, key := range keys {
			sec := newBrokerUserSecret(stack, cfg, key)
			a.secrets[key] = sec
			a.users[key] = sec.SecretArn()
		}
	case TransportNATS:
		a.top, _ = LoadTopologyFile("natsTopology", cfg.NATS.TopologyFile)
		a.common = map[string]*string{
			"FIFOBOX_TRANSPORT":     jsii.String(TransportNATS),
			"FIFOBOX_NATS_URL":      jsii.String(cfg.NATS.URL),
			"FIFOBOX_NATS_TOPOLOGY": jsii.String(a.top.JSON),
		}
		if cfg.NATS.SecretArn != "" {
			a.secrets[""] = awssecretsmanager.Secret_FromSecretCompleteArn(stack, jsii.String("NatsSecret"), jsii.String(cfg.NATS.SecretArn))
		}
		for key, arn := range cfg.NATS.SecretArns {
			a.secrets[key] = awssecretsmanager.Secret_FromSecretCompleteArn(stack, jsii.String("NatsSecret-"+key), jsii.String(arn))
		}
	}
	return a
}

// secret is key's own secret, or the one every function shares (NATS's
// natsSecretArn); nil: none.
func (a *brokerAccess) secret(key string) awssecretsmanager.ISecret {
	if s, ok := a.secrets[key]; ok {
		return s
	}
	return a.secrets[""]
}

// env is the broker environment of the function with broker user key.
func (a *brokerAccess) env(stack awscdk.Stack, key string) map[string]*string {
	env := map[string]*string{}
	for k, v := range a.common {
		env[k] = v
	}
	if s := a.secret(key); s != nil {
		if env["FIFOBOX_TRANSPORT"] != nil && *env["FIFOBOX_TRANSPORT"] == TransportNATS {
			env["FIFOBOX_NATS_SECRET_ARN"] = s.SecretArn()
		} else {
			env["FIFOBOX_AMQP_SECRET_ARN"] = s.SecretArn()
		}
	}
	if key == BrokerUserProvisioner && len(a.users) > 0 {
		env["FIFOBOX_AMQP_USER_SECRETS"] = stack.ToJsonString(a.users, nil)
	}
	return env
}

// grant lets role read key's secret (and, for the provisioner, every
// function's, whose users it creates).
func (a *brokerAccess) grant(key string, role awsiam.Role) {
	if s := a.secret(key); s != nil {
		s.GrantRead(role, nil)
	}
	if key == BrokerUserProvisioner && len(a.users) > 0 { // RabbitMQ: it creates the others' users
		for k, s := range a.secrets {
			if k != BrokerUserProvisioner && k != "" {
				s.GrantRead(role, nil)
			}
		}
	}
}

// newBrokerUserSecret generates function key's broker user secret
// {"username","password"} (letters and digits: it goes into an AMQP URL).
func newBrokerUserSecret(stack awscdk.Stack, cfg Config, key string) awssecretsmanager.Secret {
	id := "BrokerUser-" + strings.NewReplacer(":", "-", ".", "-", "_", "-").Replace(key)
	sec := awssecretsmanager.NewSecret(stack, jsii.String(id), &awssecretsmanager.SecretProps{
		Description: jsii.String("fifobox: the RabbitMQ broker user of " + key + " (created by the deploy's migrate with only that function's permissions)"),
		GenerateSecretString: &awssecretsmanager.SecretStringGenerator{
			SecretStringTemplate: jsii.String(`{"username":"` + BrokerUsername(cfg, key) + `"}`),
			GenerateStringKey:    jsii.String("password"),
			PasswordLength:       jsii.Number(32),
			ExcludePunctuation:   jsii.Bool(true),
		},
	})
	cdknag.NagSuppressions_AddResourceSuppressions(sec, &[]*cdknag.NagPackSuppression{{
		Id:     jsii.String("AwsSolutions-SMG4"),
		Reason: jsii.String("Secrets Manager has no rotation function for RabbitMQ users: the deploy's migrate sets the user's password from this secret (management API), so rotating means changing the secret and deploying; docs/deploying.md describes it."),
	}}, nil)
	return sec
}

// newBrokerConsumers creates, per consumer of the RabbitMQ topology, its
// function (in the VPC, reaching the database like every function and the
// broker for retries and dead letters) on an Amazon MQ event source reading
// its queue as the consumer's own broker user.
func newBrokerConsumers(stack awscdk.Stack, cfg Config, net *Network, p *Pipeline,
	common func(string, map[string]*string) *map[string]*string, access *brokerAccess) {
	b := net.Broker
	for _, c := range access.top.Consumers {
		key := BrokerUserConsumer(c.Name)
		env := access.env(stack, key)
		env["FIFOBOX_CONSUMER_NAME"] = jsii.String(c.Name)
		env["FIFOBOX_METRICS_NAMESPACE"] = jsii.String(cfg.Namespace())
		fn, role := newFunction(stack, cfg, net, "Consumer-"+c.Name, FnConsumer, functionOptions{
			description: "fifobox consumer " + c.Name + " (RabbitMQ queue " + c.QueueName() + ")",
			logsKey:     p.LogsKey,
			timeout:     BrokerConsumerTimeoutSeconds,
			memoryMB:    cfg.ConsumerMemoryMB,
			env:         common(FnConsumer, env),
		})
		grantDB(cfg, net, FnConsumer, role)
		access.grant(key, role)
		// What Lambda's Amazon MQ event source does with the function's
		// role: look the broker up, read the BASIC_AUTH secret (granted
		// above), and place its pollers' network interfaces in the broker's
		// subnets (the role's VPC statement covers the rest).
		role.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
			Sid: jsii.String("EventSourceDescribeBroker"), Actions: jsii.Strings("mq:DescribeBroker"), Resources: &[]*string{b.Arn},
		}))
		role.AddToPolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
			Sid:       jsii.String("EventSourceNetwork"),
			Actions:   jsii.Strings("ec2:DescribeSecurityGroups", "ec2:DescribeVpcs"),
			Resources: jsii.Strings("*"),
		}))
		esm := awslambda.NewCfnEventSourceMapping(stack, jsii.String("EventSource-"+c.Name), &awslambda.CfnEventSourceMappingProps{
			FunctionName:   fn.FunctionArn(),
			EventSourceArn: b.Arn,
			Queues:         jsii.Strings(c.QueueName()),
			BatchSize:      jsii.Number(BrokerConsumerBatchSize),
			SourceAccessConfigurations: []any{
				// The consumer's own user: it may read its queue only.
				&awslambda.CfnEventSourceMapping_SourceAccessConfigurationProperty{Type: jsii.String("BASIC_AUTH"), Uri: access.secret(key).SecretArn()},
				&awslambda.CfnEventSourceMapping_SourceAccessConfigurationProperty{Type: jsii.String("VIRTUAL_HOST"), Uri: jsii.String(cfg.AMQP.VirtualHost)},
			},
		})
		// Lambda checks the role's permissions when it creates the mapping.
		esm.Node().AddDependency(role)
		p.BrokerConsumers = append(p.BrokerConsumers, &BrokerConsumer{
			Name: c.Name, Queue: c.QueueName(), DLQ: c.DLQName(), Function: fn, EventSource: esm,
		})
	}
}
